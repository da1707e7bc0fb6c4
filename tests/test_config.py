import pytest

from pipeline.config import load_config

BASE = ["input=data/in.parquet", "catalog=data/items.parquet", "output=out", "models.target=models/t"]


def test_file_plus_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "input: a.parquet\ncatalog: b.parquet\noutput: s3://bucket/out\nmodels: {target: m}\n"
        "decoding: {mode: disc, k: 5}\nrun_date: 2026-01-02\n"
    )
    cfg = load_config(str(f), ["decoding.k=20", "compute.gpus_per_actor=1", "decoding.top_m=null"])
    assert (cfg.decoding.k, cfg.decoding.mode, cfg.compute.gpus_per_actor, cfg.run_date) == (
        20,
        "disc",
        1.0,
        "2026-01-02",
    )
    assert cfg.output == "s3://bucket/out" and cfg.decoding.top_m is None
    assert len(load_config(None, BASE).run_date) == 10  # default: today


@pytest.mark.parametrize(
    "override, message",
    [
        ("decoding.k=0", "decoding.k must be an integer >= 1, got 0"),
        ("decoding.k=ten", "decoding.k must be an int, got 'ten'"),
        ("decoding.mode=greedy", "decoding.mode must be one of beam, atspeed-strict"),
        ("decoding.mode=atspeed-strict", "models.draft must be set for decoding.mode atspeed-strict"),
        ("decoding.draft_beams=3", "decoding.draft_beams must be >= decoding.k (10)"),
        ("decoding.max_prompt_tokens=0", "decoding.max_prompt_tokens must be >= 1 or null, got 0"),
        ("decoding.too_long=cut", "decoding.too_long must be drop_oldest or reject, got 'cut'"),
        ("run_date=21/11/2026", "run_date must be a date YYYY-MM-DD"),
        ("output=gs://bucket/x", "output must be a local path or an s3:// URI"),
        ("storage.endpoint=127.0.0.1:9000", "storage.endpoint must be an http(s):// URL"),
        ("compute.batches_per_task=0", "compute.batches_per_task must be >= 1, got 0"),
        ("compute.gpus=1", "unknown field compute.gpus"),
        ("storage.secret_key=abc", "storage.secret_key looks like a credential"),
        ("decoding=3", "decoding must be a section"),
        (
            "compute.num_actors=0",
            "compute.num_actors must be an integer >= 1, a range min..max (1 <= min <= max) or auto, got 0",
        ),
        (
            "compute.num_actors=all",
            "compute.num_actors must be an integer >= 1, a range min..max (1 <= min <= max) or auto, got 'all'",
        ),
        (
            "compute.num_actors=4..2",
            "compute.num_actors must be an integer >= 1, a range min..max (1 <= min <= max) or auto, got '4..2'",
        ),
        ("runs.stall_exit_s=10", "runs.stall_exit_s must be >= runs.stall_s (180), got 10"),
        ("compute.gpus_per_actor=1.5", "compute.gpus_per_actor must be >= 0, a fraction of one GPU"),
        ("compute.decode_batch=0", "compute.decode_batch must be >= 1 or null, got 0"),
        ("compute.audit_users=-1", "compute.audit_users must be an integer >= 0 (0: no audit) or null"),
        ("compute.audit_users=some", "config: compute.audit_users must be an int, got 'some'"),
        ("compute.order_by_length=3", "config: compute.order_by_length must be true or false, got 3"),
        ("runs.duplicates_driver_mb=-1", "runs.duplicates_driver_mb must be >= 0"),
        ("duplicate_items=by", "config: duplicate_items must be one of first "),
    ],
)
def test_errors_name_the_field(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, BASE + [override])


def test_actor_pools_fit_the_cluster():
    """compute.num_actors: N is up to N, as many as fit (Ray Data may shrink it to 1); min..max an autoscaling pool
    starting with what fits the cluster now; auto follows the cluster (no upper bound), starting with what fits: by
    its GPUs (fractions of a GPU share one) and its CPUs less the read side's one; the actors reserve what the config
    says."""
    from pipeline.attempt import actor_resources
    from pipeline.cluster import Pool, actor_pool

    def compute(*sets):
        return load_config(None, BASE + list(sets)).compute

    gpu = {"CPU": 64.0, "GPU": 8.0}
    assert actor_pool(compute("compute.num_actors=auto", "compute.gpus_per_actor=1"), gpu) == Pool(1, None, 8)
    quarter = compute("compute.num_actors=auto", "compute.gpus_per_actor=0.25")
    assert actor_pool(quarter, gpu).initial == 32 and actor_resources(quarter) == {"num_cpus": 1.0, "num_gpus": 0.25}
    assert actor_pool(compute("compute.num_actors=auto", "compute.gpus_per_actor=2"), gpu).initial == 4
    assert (
        actor_pool(compute("compute.num_actors=auto", "compute.gpus_per_actor=0.3"), {"CPU": 8, "GPU": 1}).initial == 3
    )
    few_cpus = compute("compute.num_actors=auto", "compute.gpus_per_actor=0.25")
    assert actor_pool(few_cpus, {"CPU": 3.0, "GPU": 1.0}).initial == 2  # each actor holds a CPU too; one is the reads'
    assert actor_pool(compute("compute.num_actors=auto", "compute.cpus_per_actor=2"), {"CPU": 8.0}).initial == 3
    assert actor_pool(compute("compute.num_actors=auto"), {"CPU": 1.0}) == Pool(1, None, 1)  # at least one
    assert actor_pool(compute("compute.num_actors=5"), gpu) == Pool(1, 5, 5)  # a number, where the cluster holds it
    assert actor_pool(compute("compute.num_actors=5"), {"CPU": 3.0}) == Pool(1, 5, 2)  # else what fits, up to it
    assert actor_pool(compute("compute.num_actors=2..16"), {"CPU": 6.0}) == Pool(2, 16, 5)  # what fits now
    assert actor_pool(compute("compute.num_actors=2..16"), {"CPU": 2.0}) == Pool(1, 16, 1)  # the reads keep their CPU
    assert actor_pool(compute("compute.num_actors=2..4"), {"CPU": 8.0}) == Pool(2, 4, 4)  # at most max
    assert actor_resources(compute()) == {"num_cpus": 1.0, "num_gpus": None}  # CPU actors reserve no GPU


def test_relaxed_verification_drafts_k_sequences():
    relaxed = BASE + ["models.draft=models/d", "decoding.mode=atspeed-relaxed"]
    assert load_config(None, relaxed).decoding.draft_beams is None
    with pytest.raises(ValueError, match=r"decoding.draft_beams is k \(10\) in atspeed-relaxed"):
        load_config(None, relaxed + ["decoding.draft_beams=40"])


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="config file .*nope.yaml not found"):
        load_config(str(tmp_path / "nope.yaml"))
    (tmp_path / "bad.yaml").write_text("input: [unclosed")
    with pytest.raises(ValueError, match="bad.yaml is not valid YAML"):
        load_config(str(tmp_path / "bad.yaml"))
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        load_config(None, BASE + ["decoding.k"])


def test_every_shipped_config_is_valid():
    """infra/configs/*.yaml and the embedded demo config load and validate as shipped (the shared-GPU example:
    fractional GPUs, num_actors auto)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    configs = sorted([*(root / "infra" / "configs").glob("*.yaml"), root / "pipeline" / "configs" / "demo.yaml"])
    assert {p.name for p in configs} >= {"demo.yaml", "production.example.yaml", "shared-gpu.example.yaml"}
    for path in configs:
        cfg = load_config(str(path), ["run_date=2026-01-02"])
        assert cfg.models.target and cfg.compute.num_actors in ("auto", 1)
    shared = load_config(str(configs[[p.name for p in configs].index("shared-gpu.example.yaml")]))
    assert (shared.compute.gpus_per_actor, shared.compute.num_actors) == (0.25, "auto")


def test_the_demo_config_names_the_command_that_makes_what_it_misses(tmp_path, monkeypatch):
    """`genrec-batch nightly` with no --config: the first of the demo's own paths this run reads that is missing,
    with its command; a draft only where the mode uses one; a path changed with --set is left to the run's checks."""
    from pipeline.config import DEMO_CONFIG, demo_missing

    monkeypatch.chdir(tmp_path)
    demo = lambda *sets: demo_missing(load_config(str(DEMO_CONFIG), list(sets)))  # noqa: E731
    assert "genrec-batch prepare --out data/beauty" in demo()
    (tmp_path / "data" / "beauty").mkdir(parents=True)
    for name in ("test.parquet", "items.parquet"):
        (tmp_path / "data" / "beauty" / name).write_bytes(b"")
    assert "genrec-batch train-target" in demo()
    (tmp_path / "models" / "demo-target").mkdir(parents=True)
    assert demo() is None  # beam search reads no draft
    assert "genrec-batch train-draft" in demo("decoding.mode=atspeed-strict")
    assert demo("decoding.mode=atspeed-strict", "models.draft=elsewhere/draft") is None
    assert demo("input=data/office/test.parquet", "models.target=~/nowhere") is None


def test_a_run_date_has_one_spelling(tmp_path, capsys):
    """run_date is exactly YYYY-MM-DD, from a config file, --set or --run-date-of: other spellings of a day that
    Python's date parser reads (ISO week dates, the basic form, a time), an impossible day or another format are
    refused naming the value and the day's spelling (exit 2), before anything is read."""
    from jobs import nightly
    from pipeline.config import scheduled_date

    for value, day in [("2026-W48-3", "2026-11-25"), ("2026W483", "2026-11-25"), ("20261125", "2026-11-25")]:
        with pytest.raises(ValueError) as e:
            load_config(None, [*BASE, f"run_date={value}"])
        assert str(e.value) == (
            f"config: run_date must be a date YYYY-MM-DD, got '{value}' (that day is written {day})"
        )
    for value in ("2026-11-25T00:00", "2026-02-30", "25.11.2026"):
        with pytest.raises(ValueError, match=f"config: run_date must be a date YYYY-MM-DD, got '{value}'$"):
            load_config(None, [*BASE, f"run_date={value}"])
    f = tmp_path / "c.yaml"
    f.write_text("run_date: 20261125\n")
    with pytest.raises(ValueError, match="got '20261125'"):
        load_config(str(f), BASE)
    f.write_text("run_date: 2026-11-25\n")
    assert load_config(str(f), BASE).run_date == "2026-11-25"
    assert nightly.main([*(x for s in BASE for x in ("--set", s)), "--set", "run_date=2026-W48-3", "--check"]) == 2
    assert "run_date must be a date YYYY-MM-DD, got '2026-W48-3'" in capsys.readouterr().err
    day = scheduled_date("nightly-29395200-abcde")  # a RayCronJob's RayJob: minutes since the epoch
    assert day == "2025-11-21" and load_config(None, [*BASE, f"run_date={day}"]).run_date == day


def test_readers_take_a_run_date_spelled_one_way(tmp_path, capsys):
    """show, export, report, evaluate and an incremental base given `run_date=D` refuse a D not spelled YYYY-MM-DD
    (exit 2, naming it); a run folder under such a folder too; an output root's newest date leaves such folders out
    (`2026-W48-3` would sort after every YYYY-MM-DD)."""
    import json

    from jobs import evaluate, export, report, show
    from pipeline import runs
    from pipeline.carry import choose_base, newest_run
    from pipeline.storage import Storage

    out = tmp_path / "out"
    for day in ("2026-11-24", "2026-W48-3"):
        run = out / f"run_date={day}" / "run_id=r"
        run.mkdir(parents=True)
        (run / "manifest.json").write_text(json.dumps({"run_id": "r", "run_date": day}))
        (run / "_SUCCESS").write_text("")
        (run.parent / "_LATEST").write_text(json.dumps({"run_id": "r"}))
    st = Storage()
    assert runs.resolve(str(out), st) == str(out / "run_date=2026-11-24" / "run_id=r")
    assert newest_run(str(out), "2026-11-30", st) == str(out / "run_date=2026-11-24" / "run_id=r")
    with pytest.raises(ValueError, match=r"run_date must be a date YYYY-MM-DD, got '2026-W48-3' \(that day is"):
        runs.resolve(str(out / "run_date=2026-W48-3" / "run_id=r"), st)
    given = str(out / "run_date=20261125")
    for main, args in [
        (show.main, [given]),
        (export.main, [given, "--to", "redis://127.0.0.1:1"]),
        (export.main, [given, "--to", f"delta+{tmp_path / 'table'}"]),
        (report.main, ["--run", given]),
        (evaluate.main, ["--run", given]),
    ]:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert f"error: {given}: run_date must be a date YYYY-MM-DD, got '20261125'" in err, (args, err)
    cfg = load_config(None, [*BASE, f"output={out}", "incremental.enabled=true", f"incremental.base={given}"])
    with pytest.raises(FileNotFoundError, match=f"incremental base {given}: .* got '20261125'"):
        choose_base(cfg, {})
