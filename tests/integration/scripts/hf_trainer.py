"""Six steps of ``transformers.Trainer`` on a tiny BERT, optionally under ``fastload.install()``.

    python hf_trainer.py --out DIR [--install]

The model is built from a config in code (no download) and the dataset lives
in memory. With ``--install`` the script calls ``fastload.install()`` first,
the one line a user adds. Prints one JSON line: the loss of every step (from
``trainer.state.log_history``) and the class of every iterator a DataLoader
handed out.
"""

import argparse
import json

import torch
from torch.utils.data import DataLoader, Dataset

ITERATORS = []


def record_iterator_classes():
    """Note the class of every iterator any DataLoader (or subclass) hands out."""
    original = DataLoader.__iter__

    def __iter__(self):
        it = original(self)
        ITERATORS.append(f"{type(it).__module__}.{type(it).__qualname__}")
        return it

    DataLoader.__iter__ = __iter__


class Sentences(Dataset):
    """Token ids fixed per index, 10% masked at random in the worker (so seeding shows)."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        ids = torch.randint(1, 100, (16,), generator=torch.Generator().manual_seed(i))
        ids[torch.rand(16) < 0.1] = 0
        return {"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long),
                "labels": torch.tensor(i % 2)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--install", action="store_true")
    args = parser.parse_args()
    if args.install:
        import fastload

        fastload.install()

    from transformers import (BertConfig, BertForSequenceClassification, Trainer,
                              TrainingArguments, set_seed)

    record_iterator_classes()
    set_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=37, vocab_size=100, max_position_embeddings=32)
    model = BertForSequenceClassification(config)
    training = TrainingArguments(
        output_dir=args.out, max_steps=6, per_device_train_batch_size=4,
        dataloader_num_workers=2, report_to=[], use_cpu=True, seed=0,
        logging_steps=1, save_strategy="no", disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=Sentences())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(json.dumps({"losses": losses, "iterators": ITERATORS}))


if __name__ == "__main__":
    main()
