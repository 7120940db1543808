"""A saved resume state as data: its format, checks, and StatefulDataLoader's.

``FastLoader.state_dict()`` returns :func:`loader_facts` (the format number
and what a state must agree with to resume exactly) merged with the
iterator's position (:mod:`fastload.resume.book`). ``load_state_dict()`` checks a
state with :func:`check_compatible`, and takes over the state dict that
torchdata's ``StatefulDataLoader`` writes, where the two map exactly
(:func:`from_stateful_dataloader`). Main process only.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

__all__ = ["FORMAT", "loader_facts", "check_compatible", "is_stateful_dataloader_state",
           "from_stateful_dataloader"]

FORMAT = 1
_KEY = "fastload_resume"


def is_stateful_dataloader_state(sd: Any) -> bool:
    """Whether ``sd`` looks like the state dict torchdata's StatefulDataLoader writes."""
    return isinstance(sd, dict) and _KEY not in sd and (
        "_snapshot" in sd or ("_num_yielded" in sd and "_sampler_iter_state" in sd))


def from_stateful_dataloader(sd: Dict[str, Any], loader: Any) -> Dict[str, Any]:
    """A fastload state from the state dict torchdata's ``StatefulDataLoader``
    writes for a map-style dataset, where the two map exactly: the position
    (batches delivered) and the sampler's order, which is the same when the
    order comes from the loader's ``generator`` (StatefulDataLoader keeps its
    state as the epoch's permutation was drawn) or from no generator at all
    (a sequential sampler). Its workers carry no generator states, so the
    workers start as fresh ones from its base seed, as its own would.
    """
    facts = loader_facts(loader)
    if facts["dataset_kind"] != "map":
        raise ValueError("load_state_dict: a StatefulDataLoader state can be taken over for a "
                         "map-style dataset only")
    main = sd["_snapshot"]["_main_snapshot"] if "_snapshot" in sd else sd
    finished = bool(sd.get("_iterator_finished", False))
    if "_snapshot" in sd:
        position = sd["_snapshot"]["_snapshot_step"] + sd.get("_steps_since_snapshot", 0)
        num_workers = main.get("_num_workers", 0)
    else:
        position, num_workers = sd["_num_yielded"], 0
    if num_workers != facts["num_workers"]:
        raise ValueError(f"load_state_dict: the StatefulDataLoader state was saved with "
                         f"num_workers={num_workers}, this loader has "
                         f"num_workers={facts['num_workers']}; resume needs the same")
    it_state = main.get("_sampler_iter_state") or {}
    it_state = it_state.get("sampler_iter_state", it_state) or {}
    generator = it_state.get("generator") if isinstance(it_state, dict) else None
    if generator is not None and not isinstance(loader.generator, torch.Generator):
        raise ValueError("load_state_dict: this StatefulDataLoader state shuffles with its own "
                         "generator; fastload can take its order over only when the loader is "
                         "given a generator (generator=torch.Generator()), as torch's "
                         "RandomSampler then draws its permutation from it")
    base_seed = main.get("_base_seed")
    if base_seed is None:
        base_seed = int(torch.empty((), dtype=torch.int64).random_().item())
    start = {"torch_rng": torch.get_rng_state(), "generator": generator, "samplers": {},
             "first_iter": False, "base_seed": base_seed}
    nw = facts["num_workers"]
    return {**facts, "position": None if finished else int(position), "delivered_ahead": [],
            "epoch_start": start, "base_seed": base_seed, "next_worker": int(position) % max(nw, 1),
            "workers_active": [True] * nw, "workers": [None] * nw, "dataset_state": None}


def check_compatible(saved: Dict[str, Any], here: Dict[str, Any]) -> None:
    """Raise ValueError naming what differs between a saved state and this loader."""
    if not isinstance(saved, dict) or _KEY not in saved:
        raise ValueError("load_state_dict: not a fastload loader state (no "
                         f"'{_KEY}' entry); got keys {sorted(saved)[:8] if isinstance(saved, dict) else type(saved).__name__}")
    if saved[_KEY] != FORMAT:
        raise ValueError(f"load_state_dict: state format {saved[_KEY]} was written by another "
                         f"fastload version; this one reads format {FORMAT}")
    for key in ("num_workers", "batch_size", "drop_last", "dataset_kind", "dataset_len",
                "persistent_workers"):
        if saved.get(key) != here.get(key):
            raise ValueError(f"load_state_dict: the state was saved with {key}={saved.get(key)!r}, "
                             f"this loader has {key}={here.get(key)!r}; resume needs the same")


def loader_facts(loader: Any) -> Dict[str, Any]:
    """What a state must agree with to resume exactly on ``loader``."""
    from torch.utils.data import _DatasetKind

    kind = "map" if loader._dataset_kind == _DatasetKind.Map else "iterable"
    length = None
    if kind == "map":
        try:
            length = len(loader.dataset)
        except TypeError:
            pass
    state = vars(loader).get("_fastload_state") if hasattr(loader, "__dict__") else None
    auto = state is not None and state.options.auto_workers and loader.num_workers > 0
    return {_KEY: FORMAT, "num_workers": "auto" if auto else loader.num_workers,
            "batch_size": loader.batch_size,
            "drop_last": loader.drop_last, "dataset_kind": kind, "dataset_len": length,
            "persistent_workers": bool(loader.persistent_workers and loader.num_workers > 0)}
