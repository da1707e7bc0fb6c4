"""Upload a model folder to object storage for the nightly: `genrec-batch upload-model LOCAL_DIR s3://BUCKET/PREFIX
--catalog items.parquet`.

The folder is checked first, and nothing is written unless it passes: safetensors weights (a pickled file such as
pytorch_model.bin or *.pt is refused), config.json of a causal LM, a tokenizer, and the prompt template
(genrec_template.json: `genrec-batch template` writes it), whose prompts must render for the catalog's items. Then
its files are uploaded, sha256sums.json last, and every object is read back and checked against its sha256. Exit 0
with a JSON summary; 2 when the folder or the catalog is refused (naming what is missing) or the prefix holds another
model; 4 when the object store stayed unavailable for the retry budget. Credentials come from the environment.
"""

from __future__ import annotations

import argparse
import json
import sys

from jobs.cli import prog, storage_args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("jobs.upload_model"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "local_dir", metavar="LOCAL_DIR", help="the model folder (config.json, weights, tokenizer, template)"
    )
    p.add_argument("uri", metavar="S3_URI", help="where the model goes, e.g. s3://bucket/models/target-v3")
    p.add_argument(
        "--catalog", required=True, help="items.parquet the nightly reads (path or s3:// URI): the template's check"
    )
    storage_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipeline.models import upload_model
    from pipeline.storage import Storage, StoreUnavailable

    try:
        summary = upload_model(args.local_dir, args.uri, args.catalog, Storage(args.endpoint, args.region))
    except (FileNotFoundError, ValueError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StoreUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
