#!/usr/bin/env python
"""Convert a math dataset (DeepScaleR, MATH-500, GSM8K, AIME, AMC, or ours) to the canonical prompt format.

Example:
    python tools/prepare_data.py --input ../shared/data/math500.jsonl --output data/math500.jsonl
    python tools/prepare_data.py --input gsm8k/test.parquet --output data/gsm8k.parquet --data-source gsm8k \\
        --tokenizer /models/Qwen2.5-7B --max-prompt-length 512
"""

from __future__ import annotations

import argparse
import sys

from megatron_pacs.data import BadRowError, prepare_dataset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="source file: .json, .jsonl or .parquet")
    p.add_argument("--output", required=True, help="destination: .jsonl or .parquet (written atomically)")
    p.add_argument("--data-source", default=None, help="dataset name stored in each row (default: input file stem)")
    p.add_argument("--skip-bad-rows", action="store_true", help="skip malformed rows and report how many")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory for --max-prompt-length")
    p.add_argument("--max-prompt-length", type=int, default=None, help="drop prompts longer than N tokens")
    args = p.parse_args(argv)
    try:
        report = prepare_dataset(
            args.input,
            args.output,
            data_source=args.data_source,
            skip_bad_rows=args.skip_bad_rows,
            tokenizer_dir=args.tokenizer,
            max_prompt_length=args.max_prompt_length,
        )
    except (BadRowError, ValueError, FileNotFoundError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        if isinstance(e, BadRowError):
            print("prepare_data: pass --skip-bad-rows to skip malformed rows and count them", file=sys.stderr)
        return 2
    print(
        f"wrote {report.num_written} rows to {report.output} "
        f"({report.num_bad_skipped} malformed rows skipped, {report.num_too_long} over-long prompts dropped)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
