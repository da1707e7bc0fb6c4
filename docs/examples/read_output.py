"""Read the newest published run of a nightly's output with pandas and with DuckDB:

    python docs/examples/read_output.py OUTPUT      # OUTPUT: the config's `output`, a path or an s3:// URI

`open_run` resolves the output to its newest published run and builds each table from the files its manifest lists
(never a listing of the run's folders); s3:// uses the credentials, AWS_ENDPOINT_URL and AWS_REGION of the
environment. docs/output.md describes every column.
"""

import sys

import duckdb

import genrec_batch as gb


def main(output: str) -> None:
    run = gb.open_run(output)
    print(f"run {run.run_id} of {run.run_date}: {run.uri}")

    # pandas: the whole recommendations table in memory, each user's top 3 (rank 1 is the best)
    recs = run.table("recommendations", columns=["user_id", "rank", "item_id", "score"]).to_pandas()
    top3 = recs[recs["rank"] <= 3].sort_values(["user_id", "rank"])
    print(top3.head(6).to_string(index=False))

    # DuckDB: SQL over the same pyarrow datasets, scanned where they lie (local files or S3)
    db = duckdb.connect()
    for name in ("recommendations", "rejects"):
        db.register(name, run.dataset(name))
    ((users, rows),) = db.sql("SELECT count(DISTINCT user_id), count(*) FROM recommendations").fetchall()
    print(f"users {users}, recommendations {rows}")
    for reason, n in db.sql("SELECT reason, count(*) FROM rejects GROUP BY reason ORDER BY reason").fetchall():
        print(f"rejected {n}: {reason}")


if __name__ == "__main__":
    main(sys.argv[1])
