"""Frozen-backbone features, extracted once and cached on disk in float16 shards.

The cache folder's name is a hash of everything that changes the features (data
source and preprocessing, backbone and its weights file); ``manifest.json`` inside
records those fields and is checked on every use, so features from another backbone
or preprocessing are never silently reused -- a different configuration gets its
own folder and is rebuilt. Shards are written atomically one by one, so an
interrupted extraction resumes at the first missing shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from ...runtime import distributed
from ...runtime.checkpoints import load_checkpoint
from ...runtime.errors import CheckpointError, DataError, clip
from ...runtime.io import atomic_torch_save, atomic_write_json
from ...runtime.progress import progress_bar
from ...runtime.safefs import output_folder

log = logging.getLogger(__name__)
RANDOM_BACKBONE_SEED = 0
RESNET50_FILES = ("resnet50-11ad3fa6.pth", "resnet50-0676ba61.pth")  # torchvision's IMAGENET1K_V2 and _V1


def _weights_file(weights) -> Optional[Path]:
    if weights in (None, "", "random"):
        return None
    if weights == "torchvision":
        checkpoints = Path(torch.hub.get_dir()) / "checkpoints"
        for name in RESNET50_FILES:
            if (checkpoints / name).is_file():
                return checkpoints / name
        raise DataError(
            f"backbone.weights=torchvision: no ResNet50 weights in torchvision's cache {checkpoints} "
            f"(looked for {', '.join(RESNET50_FILES)}); nothing is downloaded at run time -- copy the file there, "
            "or set backbone.weights=/path/to/resnet50.pth"
        )
    path = Path(weights)
    if not path.is_file():
        raise DataError(
            f"backbone.weights={weights}: file not found; put a torchvision ResNet50 state dict there "
            f"(e.g. {RESNET50_FILES[0]} from torchvision's model zoo), or use backbone.weights=torchvision"
        )
    return path


def build_backbone(name: str, weights, device) -> Tuple[Optional[nn.Module], dict]:
    """``(module or None for identity, description)``; ResNet50 with its final layer removed (2048 features)."""
    if name == "identity":
        return None, {"backbone": "identity"}
    from torchvision.models import resnet50

    path = _weights_file(weights)
    # a random backbone is seeded: every shard of a cache (also one resumed later) must
    # come from the same network
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_BACKBONE_SEED)
        model = resnet50(weights=None)
    if path is None:
        log.warning(
            "backbone.weights is not set: a randomly initialized ResNet50 (features are not meaningful; "
            "set backbone.weights=/path/to/resnet50.pth or backbone.weights=torchvision)"
        )
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            model.load_state_dict(state.get("state_dict", state) if isinstance(state, dict) else state)
        except Exception as error:
            raise DataError(
                f"backbone.weights={path} is not a torchvision ResNet50 state dict ({type(error).__name__}: "
                f"{clip(error, 200)})"
            ) from None
    model.fc = nn.Identity()
    model.eval().to(device)
    stat = path.stat() if path is not None else None
    description = {
        "backbone": "resnet50",
        "weights": str(path) if path else f"random (seed {RANDOM_BACKBONE_SEED})",
        "weights_bytes": stat.st_size if stat else None,
        "weights_mtime": int(stat.st_mtime) if stat else None,
    }
    return model, description


def load_feature_shard(path: Path) -> dict:
    """One cached shard (``features`` (n, F) float, ``labels`` (n,) integers, ``ok`` (n,)), loaded
    without running code and checked: a file of another structure is a one-line
    :class:`CheckpointError` naming it."""
    shard = load_checkpoint(path, what="feature shard")
    features, labels, ok = (shard.get(key) for key in ("features", "labels", "ok"))
    problem = None
    if not all(isinstance(t, torch.Tensor) for t in (features, labels, ok)):
        problem = "it lacks the tensors features, labels and ok"
    elif features.dim() != 2 or not features.is_floating_point():
        problem = f"its features are {tuple(features.shape)} {features.dtype}, not a (rows, features) float matrix"
    elif labels.dim() != 1 or labels.is_floating_point() or labels.is_complex():
        problem = "its labels are not one integer per row"
    elif ok.dim() != 1 or not len(features) == len(labels) == len(ok):
        problem = f"its features, labels and ok have {len(features)}, {len(labels)} and {len(ok)} rows"
    elif not bool(torch.isfinite(features[ok.bool()]).all()):
        # named here: in training it would surface as a NaN loss, with a learning-rate hint
        rows = (~torch.isfinite(features).all(1) & ok.bool()).nonzero().flatten()[:5].tolist()
        problem = f"its features hold NaN or infinite values (rows {rows})"
    if problem is not None:
        raise CheckpointError(
            f"{path} is not a cfbnn feature shard ({problem}); delete {path.parent} to extract its features again"
        )
    return shard


def cache_folder(cache_dir, fields: dict) -> Path:
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{fields.get('data', 'data')}-{fields.get('backbone', 'backbone')}-{digest}"


def extract(
    dataset,
    split: str,
    backbone: Optional[nn.Module],
    folder: Path,
    fields: dict,
    device,
    batch_size: int = 128,
    shard_size: int = 4096,
    num_workers: int = 0,
    num_classes: Optional[int] = None,
):
    """``(features float16 (N, F), labels (N,), skipped)`` for ``dataset``, cached in ``folder``
    (every shard checked: one width, labels in ``0..num_classes-1``)."""
    output_folder(folder)  # below the run dir: made or checked without following a link
    manifest_path = folder / "manifest.json"
    if manifest_path.exists():
        try:
            recorded = json.loads(manifest_path.read_text())["fields"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise DataError(
                f"{manifest_path} is unreadable ({type(error).__name__}); delete {folder} to rebuild its features"
            ) from None
        if recorded != json.loads(json.dumps(fields, default=str)):
            raise DataError(
                f"{folder}: its manifest records other settings than this run's; delete the folder to rebuild"
            )
    else:
        atomic_write_json(manifest_path, {"fields": fields})
    shards = math.ceil(len(dataset) / shard_size)
    paths = [folder / f"{split}_{index:05d}.pt" for index in range(shards)]
    # under torchrun each rank extracts every world_size-th missing shard
    todo = [index for index, path in enumerate(paths) if not path.exists()][
        distributed.rank() :: distributed.world_size()
    ]
    if todo:
        log.info("extracting %s features: %d of %d shards to do, into %s", split, len(todo), shards, folder)
        with progress_bar(
            total=sum(min(shard_size, len(dataset) - i * shard_size) for i in todo),
            desc=f"features {split}",
            leave=False,
            disable=not distributed.is_main(),
        ) as bar:
            for index in todo:
                rows = range(index * shard_size, min((index + 1) * shard_size, len(dataset)))
                loader = DataLoader(Subset(dataset, list(rows)), batch_size=batch_size, num_workers=num_workers)
                features, labels, ok = [], [], []
                with torch.inference_mode():
                    for images, label, good in loader:
                        images = images.to(device, non_blocking=True)
                        out = images.flatten(1) if backbone is None else backbone(images)
                        features.append(out.float().cpu().to(torch.float16))
                        labels.append(label)
                        ok.append(good)
                        bar.update(len(label))
                atomic_torch_save(
                    {"features": torch.cat(features), "labels": torch.cat(labels), "ok": torch.cat(ok)}, paths[index]
                )
    distributed.barrier()  # every rank's shards are on disk before anyone reads them
    parts = [load_feature_shard(path) for path in paths]
    widths = sorted({p["features"].shape[1] for p in parts})
    # an unreadable image's row (ok = 0) carries a placeholder label
    labels_seen = torch.cat([p["labels"][p["ok"].bool()] for p in parts]) if parts else torch.zeros(0, dtype=torch.long)
    if len(widths) > 1 or (
        num_classes is not None
        and len(labels_seen)
        and not 0 <= int(labels_seen.min()) <= int(labels_seen.max()) < num_classes
    ):
        problem = (
            f"its shards hold features of widths {widths}"
            if len(widths) > 1
            else f"its labels run from {int(labels_seen.min())} to {int(labels_seen.max())}, outside the "
            f"{num_classes} classes of the data"
        )
        raise CheckpointError(
            f"the feature cache {folder} is inconsistent ({problem}); delete the folder to extract its features again"
        )
    features = torch.cat([p["features"] for p in parts])
    labels = torch.cat([p["labels"] for p in parts])
    ok = torch.cat([p["ok"] for p in parts]).bool()
    skipped = int((~ok).sum())
    if skipped:
        log.warning("%s: %d unreadable images skipped", split, skipped)
    return features[ok], labels[ok], skipped
