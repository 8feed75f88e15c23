#!/usr/bin/env python
"""Write a random-weight checkpoint of a real model shape (headlab.core.shapes), tensor by tensor, for the scale
benchmarks (docs/scaling.md): memory and time of headlab's commands at 8B without downloading a model.

    python scripts/make_shape.py llama-3.1-8b --out /data/llama-8b-shape              # 32 layers, bf16, ~16 GB
    python scripts/make_shape.py qwen3-8b --layers 8 --out /data/qwen3-8b-8layers     # the time-linearity points
"""

from __future__ import annotations

import argparse
import json
import sys

from headlab.core.errors import HeadlabError
from headlab.core.shapes import DTYPES, SHAPES, write_random_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the published count)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    try:
        record = write_random_checkpoint(args.shape, args.out, layers=args.layers, dtype=args.dtype, seed=args.seed,
                                         overwrite=args.overwrite)  # fmt: skip
    except HeadlabError as error:
        print(f"make_shape: {error}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
