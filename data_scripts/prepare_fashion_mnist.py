"""Prepare Fashion-MNIST for `cfbnn vae data=fashion_mnist` from Debian's package.

    apt-get install dataset-fashion-mnist           # the gzipped IDX files, offline-friendly
    python data_scripts/prepare_fashion_mnist.py --out data/fashion_mnist

Finds the four ``*-idx?-ubyte.gz`` files (``--source``, default: the package's
``/usr/share/datasets/fashion-mnist``, or wherever ``dpkg -L dataset-fashion-mnist``
lists them), checks each IDX header, and gunzips them into
``<out>/FashionMNIST/raw/`` -- the layout ``torchvision.datasets.FashionMNIST`` reads
with ``download=False``. Files are written atomically; existing ones are replaced.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

FILES = {
    "train-images-idx3-ubyte": (2051, 60000),
    "train-labels-idx1-ubyte": (2049, 60000),
    "t10k-images-idx3-ubyte": (2051, 10000),
    "t10k-labels-idx1-ubyte": (2049, 10000),
}
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")


def debian_files():
    try:
        listing = subprocess.run(
            ["dpkg", "-L", "dataset-fashion-mnist"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [Path(line) for line in listing.splitlines() if line.endswith("-ubyte.gz")]


def find_sources(source):
    candidates = {}
    paths = list(Path(source).glob("*-ubyte.gz")) if source else []
    if not paths:
        paths = list(DEBIAN_DIR.glob("*-ubyte.gz")) or debian_files()
    for path in paths:
        candidates[path.name[: -len(".gz")]] = path
    missing = [name for name in FILES if name not in candidates]
    if missing:
        where = source or DEBIAN_DIR
        raise SystemExit(
            f"error: {', '.join(m + '.gz' for m in missing)} not found in {where}; "
            "install them with `apt-get install dataset-fashion-mnist` or pass --source DIR"
        )
    return candidates


def check_header(path: Path, name: str, full: bool, source: Path):
    with path.open("rb") as handle:
        magic, count = struct.unpack(">II", handle.read(8))
    path = source  # errors name the file the user has
    expected_magic, expected_count = FILES[name]
    if magic != expected_magic:
        raise SystemExit(
            f"error: {path} is not an IDX file of the expected kind (magic {magic}, expected {expected_magic})"
        )
    if full and count != expected_count:
        raise SystemExit(f"error: {path} holds {count} items, expected {expected_count}; the file is incomplete")
    return count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/fashion_mnist", help="folder to create FashionMNIST/raw/ in")
    parser.add_argument(
        "--source", default=None, help="folder holding the *-ubyte.gz files (default: the Debian package's)"
    )
    parser.add_argument("--allow-subset", action="store_true", help=argparse.SUPPRESS)  # tests use tiny files
    args = parser.parse_args(argv)
    sources = find_sources(args.source)
    raw = Path(args.out) / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name, source in sorted(sources.items()):
        if name not in FILES:
            continue
        handle, temporary = tempfile.mkstemp(dir=raw, prefix=f".{name}.")
        try:
            with os.fdopen(handle, "wb") as out, gzip.open(source, "rb") as compressed:
                shutil.copyfileobj(compressed, out)
            count = check_header(Path(temporary), name, not args.allow_subset, source)
            os.replace(temporary, raw / name)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        print(f"{raw / name}: {count} items")
    return 0


if __name__ == "__main__":
    sys.exit(main())
