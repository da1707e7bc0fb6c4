"""The decode benchmark runs end to end on real Beauty prompts and reports agreement with transformers."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEAUTY = ROOT.parent / "shared" / "datasets" / "amazon-beauty"


def test_bench_decode_small(tmp_path):
    data, out = tmp_path / "beauty", tmp_path / "out"
    subprocess.run([sys.executable, "-m", "jobs.prepare_data", "--source", str(BEAUTY), "--out", str(data)],
                   cwd=ROOT, check=True, capture_output=True)
    run = subprocess.run([sys.executable, "-m", "jobs.bench", "decode", "--data", str(data), "--users", "6",
                          "--batch", "3", "--k", "5", "--layers", "1", "--hidden", "32", "--heads", "2",
                          "--index-items", "3000", "--repeats", "1", "--device", "cpu", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    result = json.loads((out / "decode.json").read_text())
    decode = result["decode"]
    assert decode["agreement"] == {"users": 6, "same_items_same_order": 1.0, "same_item_set": 1.0,
                                   "max_abs_score_diff": decode["agreement"]["max_abs_score_diff"]}
    assert decode["agreement"]["max_abs_score_diff"] < 1e-4
    assert decode["methods"]["beam_search"]["kv_tokens_per_user"] < decode["methods"]["transformers"]["kv_tokens_per_user"]
    assert [r["items"] for r in result["index"]] == [12023, 3000]
    assert "speed-up" in (out / "decode.md").read_text()


def test_bench_bad_arguments():
    run = subprocess.run([sys.executable, "-m", "jobs.bench", "decode", "--k", "0"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 2 and "expected a positive integer, got 0" in run.stderr
    run = subprocess.run([sys.executable, "-m", "jobs.bench", "decode", "--data", "/nonexistent"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode != 0 and "/nonexistent/items.parquet not found" in run.stderr


def test_bench_disc_small(tmp_path):
    import shutil

    from decoding.models import build_model

    data, out, model = tmp_path / "beauty", tmp_path / "out", tmp_path / "model"
    subprocess.run([sys.executable, "-m", "jobs.prepare_data", "--source", str(BEAUTY), "--out", str(data)],
                   cwd=ROOT, check=True, capture_output=True)
    build_model(1028, 1, 32, 2, 1).save_pretrained(model)
    for f in (data / "tokenizer").iterdir():
        shutil.copy(f, model / f.name)
    run = subprocess.run([sys.executable, "-m", "jobs.bench", "disc", "--data", str(data), "--model", str(model),
                          "--users", "4", "--batch", "2", "--k", "3", "--max-rounds", "2", "--top-m", "20",
                          "--device", "cpu", "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    methods = json.loads((out / "disc.json").read_text())["disc"]["methods"]
    assert set(methods) == {"beam_search", "constrained_sample", "disc rounds=1 exact", "disc rounds=2 exact",
                            "disc rounds=1 PPV top-20", "disc rounds=2 PPV top-20"}
    assert methods["constrained_sample"]["acceptance_rate"] == 1.0
    assert all(0 <= m["invalid_mass"] <= 1 for n, m in methods.items() if n != "beam_search")
