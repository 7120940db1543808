"""The integration group: fastload with the libraries users run it under.

Each test runs a real script, notebook or launcher in a subprocess and
compares fastload with torch.utils.data.DataLoader on the same seed.
``yolo_train.py`` is a standalone script (it needs ultralytics and
torchvision), not a test.
"""

collect_ignore = ["yolo_train.py", "scripts"]
