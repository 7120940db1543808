"""Execute a notebook on the ``python3`` Jupyter kernel, as ``jupyter execute`` does.

    python run_notebook.py NOTEBOOK.ipynb

Prints the text every cell printed, in order; exits non-zero (with the
cell's traceback) if a cell raised.
"""

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

path = Path(sys.argv[1])
notebook = nbformat.read(path, as_version=4)
NotebookClient(
    notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
).execute()
for cell in notebook.cells:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream" and output.get("name") == "stdout":
            sys.stdout.write(output["text"])
