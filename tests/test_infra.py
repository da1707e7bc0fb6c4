"""infra/ without a cluster: every manifest (and every document embedded in one) against the schemas in
tests/schemas (KubeRay's CRDs, Kubernetes 1.33 strict, Ray 2.60's cluster launcher and runtime_env), the versions
pinned in constraints.txt everywhere (inside pyproject.toml's ranges), the RayJob's fixed name per run date and
short TTL, the launcher's AlreadyExists handling, and the head node's right to pass the worker role."""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml
from jsonschema.validators import validator_for
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "tests" / "schemas"
INFRA = ROOT / "infra"
MANIFESTS = sorted((INFRA / "kuberay").glob("*.yaml"))
LAUNCHER = INFRA / "cluster" / "aws-gpu.yaml"
RUNTIME_ENV = INFRA / "runtime_env.yaml"


# KubeRay kinds -> the CRD schemas each document is checked against (both KubeRay versions where both serve it).
KUBERAY = {
    "RayJob": ["kuberay-v1.5.1-rayjob-v1.json", "kuberay-v1.7.0-rayjob-v1.json"],
    "RayCluster": ["kuberay-v1.5.1-raycluster-v1.json", "kuberay-v1.7.0-raycluster-v1.json"],
    "RayCronJob": ["kuberay-v1.7.0-raycronjob-v1.json"],
}
K8S = "k8s-v1.33.0-strict.json"
OBJECT_META = "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@cache
def schema(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())


def errors(doc, name: str, ref: str | None = None) -> list[str]:
    """Schema errors of `doc` against the schema file `name` (or its definition `ref`), one line each."""
    s = schema(name) if ref is None else {**schema(name), "$ref": ref}
    found = validator_for(s)(s).iter_errors(doc)
    return [f"/{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in sorted(found, key=lambda e: e.json_path)]


def checks(doc: dict, where: str, versions: tuple[str, ...] = ("v1.5.1", "v1.7.0")):
    """(where, document, schema file, $ref) for a manifest document and every document embedded in it: List
    items, a RayCronJob's RayJob template, a RayJob's RayCluster spec and runtime_env YAML."""
    api, kind = doc.get("apiVersion"), doc.get("kind")
    if (api, kind) == ("v1", "List"):  # kubectl's List: no schema of its own, each item checked as itself
        for i, item in enumerate(doc["items"]):
            yield from checks(item, f"{where} items[{i}] {item.get('kind')}", versions)
        return
    if api == "ray.io/v1" and kind in KUBERAY:
        for name in KUBERAY[kind]:
            if any(v in name for v in versions):
                yield where, doc, name, None
        if "metadata" in doc:  # the CRDs leave metadata open: check it as Kubernetes' ObjectMeta
            yield f"{where} metadata", doc["metadata"], K8S, OBJECT_META
        spec = doc.get("spec", {})
        if kind == "RayCronJob":  # a RayJob spec, created as is by KubeRay (>= 1.6, so the 1.7.0 schema only)
            rayjob = {"apiVersion": api, "kind": "RayJob", "spec": spec.get("jobTemplate")}
            yield from checks(rayjob, f"{where} jobTemplate", ("v1.7.0",))
        if kind == "RayJob" and "rayClusterSpec" in spec:
            raycluster = {"apiVersion": api, "kind": "RayCluster", "spec": spec["rayClusterSpec"]}
            yield from checks(raycluster, f"{where} rayClusterSpec", versions)
        if kind == "RayJob" and "runtimeEnvYAML" in spec:
            yield f"{where} runtimeEnvYAML", yaml.safe_load(spec["runtimeEnvYAML"]), "ray-2.60.0-runtime-env.json", None
        return
    ref = schema(K8S)["kinds"].get(f"{api} {kind}")
    assert ref, f"{where}: no schema in {SCHEMAS / K8S} for apiVersion {api} kind {kind}"
    yield where, doc, K8S, ref


def all_checks(docs_by_file: dict[str, list[dict]]):
    for file, docs in docs_by_file.items():
        for i, doc in enumerate(docs):
            yield from checks(doc, f"{file}[{i}] {doc.get('kind')}")


def manifest_errors(docs_by_file: dict[str, list[dict]]) -> list[str]:
    return [
        f"{where}: {name}{ref or ''} at {e}"
        for where, doc, name, ref in all_checks(docs_by_file)
        for e in errors(doc, name, ref)
    ]


def kuberay_docs() -> dict[str, list[dict]]:
    return {p.name: yaml_docs(p) for p in MANIFESTS}


# --- every document against its schemas --------------------------------------------------------------------------


def test_every_kuberay_document_validates_against_every_schema_it_falls_under():
    docs = kuberay_docs()
    assert {"rayjob-nightly.yaml", "raycronjob-nightly.yaml", "cronjob-nightly.yaml"} <= set(docs)
    assert manifest_errors(docs) == []
    checked = {(where.split("[")[0], name, ref) for where, _, name, ref in all_checks(docs)}
    used = {name for _, name, _ in checked}
    # every KubeRay schema (both versions) and the Kubernetes one are used, the runtime_env one on embedded YAML
    assert used == {n for names in KUBERAY.values() for n in names} | {K8S, "ray-2.60.0-runtime-env.json"}
    kinds = {ref.rsplit(".", 1)[-1] for _, name, ref in checked if name == K8S}
    assert {"CronJob", "ServiceAccount", "Role", "RoleBinding", "ObjectMeta"} <= kinds
    assert ("raycronjob-nightly.yaml", "kuberay-v1.7.0-raycluster-v1.json", None) in checked  # nested twice


def test_cluster_launcher_and_runtime_env_validate():
    assert errors(yaml.safe_load(LAUNCHER.read_text()), "ray-2.60.0-cluster-launcher.json") == []
    assert errors(yaml.safe_load(RUNTIME_ENV.read_text()), "ray-2.60.0-runtime-env.json") == []


BREAKS = [  # (file, path into its first document, value): an unknown field or a wrong type somewhere deep
    ("rayjob-nightly.yaml", ["spec", "ttlSecondsAfterFinished"], "600"),
    ("rayjob-nightly.yaml", ["spec", "ttlSecondAfterFinished"], 600),
    (
        "rayjob-nightly.yaml",
        ["spec", "rayClusterSpec", "workerGroupSpecs", 0, "template", "spec", "containers", 0, "imagePullPolicyy"],
        "Always",
    ),
    ("rayjob-nightly.yaml", ["spec", "rayClusterSpec", "headGroupSpec", "rayStartParams", "num-cpus"], 4),
    ("rayjob-nightly.yaml", ["metadata", "generateName"], 7),
    ("rayjob-nightly.yaml", ["spec", "runtimeEnvYAML"], "env_vars: {A: '1'}\nworking_dirr: .\n"),
    ("raycronjob-nightly.yaml", ["spec", "concurrencyPolicy"], "Forbid"),
    (
        "raycronjob-nightly.yaml",
        [
            "spec",
            "jobTemplate",
            "rayClusterSpec",
            "headGroupSpec",
            "template",
            "spec",
            "containers",
            0,
            "resources",
            "limit",
        ],
        {"cpu": "1"},
    ),
    (
        "cronjob-nightly.yaml",
        ["items", 3, "spec", "jobTemplate", "spec", "template", "spec", "containers", 0, "volumeMount"],
        [],
    ),
    ("cronjob-nightly.yaml", ["items", 2, "roleRef", "name"], 1),
]


@pytest.mark.parametrize("file,path,value", BREAKS, ids=[f"{f}:{p[-1]}" for f, p, _ in BREAKS])
def test_an_unknown_field_or_a_wrong_type_fails_validation(file, path, value):
    docs = kuberay_docs()
    broken = copy.deepcopy(docs[file][0])
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    found = manifest_errors({file: [broken]})
    assert found and all(str(path[-1]) in e or repr(value) in e for e in found), found


@pytest.mark.parametrize(
    "file,schema_name,key,value",
    [
        (LAUNCHER, "ray-2.60.0-cluster-launcher.json", "max_worker", 8),
        (LAUNCHER, "ray-2.60.0-cluster-launcher.json", "idle_timeout_minutes", "10"),
        (RUNTIME_ENV, "ray-2.60.0-runtime-env.json", "working_dirr", "."),
        (RUNTIME_ENV, "ray-2.60.0-runtime-env.json", "env_vars", {"A": 1}),
    ],
)
def test_launcher_and_runtime_env_schemas_catch_mistakes(file, schema_name, key, value):
    doc = yaml.safe_load(file.read_text())
    doc[key] = value
    assert errors(doc, schema_name)


# --- versions: pyproject.toml declares ranges, constraints.txt pins the tested versions -----------------------------


def pinned() -> dict[str, str]:
    """constraints.txt's exact pins (name -> version), the project's version and its Python (pyproject.toml)."""
    text = (ROOT / "constraints.txt").read_text()
    pins = {name(k): v for k, v in re.findall(r"(?m)^([A-Za-z0-9_.-]+)==([0-9][^\s#]*)", text)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins["project"] = project["version"]
    pins["python"] = re.fullmatch(r">=(3\.\d+)", project["requires-python"])[1]
    return pins


def name(package: str) -> str:
    return re.split(r"[\[<>=!~; ]", package, maxsplit=1)[0].lower().replace("_", "-")


def test_pyproject_declares_ranges_and_every_pin_lies_in_them():
    """A library declares ranges (no == on torch, transformers, ray); the pins are tested versions inside them, and
    every dependency of pyproject.toml (extras included) is pinned."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requires = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    pins = pinned()
    assert not [r for r in requires if "==" in r], "pyproject.toml pins exactly: exact pins go in constraints.txt"
    outside = [r for r in requires if Version(pins[name(r)]) not in Requirement(r).specifier]
    assert outside == [], f"constraints.txt pins outside pyproject.toml's ranges: {outside}"
    lower = {name(r): Requirement(r).specifier for r in project["dependencies"] if name(r) in ("torch", "transformers")}
    assert Version("2.11") in lower["torch"] and Version("5.17") in lower["transformers"]  # the GPU image's


def test_transformers_is_admitted_up_to_the_tested_release():
    """pyproject.toml admits transformers up to the release constraints.txt pins (the suite ran under it, its
    FutureWarnings errors), not the next minor release, which may remove what this one deprecates: raising the bound
    goes with the pin. pytest's settings make transformers' FutureWarnings errors (tests/test_transformers_compat.py
    tests their scope)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    spec = next(Requirement(r).specifier for r in config["project"]["dependencies"] if name(r) == "transformers")
    pin = Version(pinned()["transformers"])
    assert pin in spec and Version(f"{pin.major}.{pin.minor + 1}") not in spec, (str(spec), str(pin))
    assert "error::FutureWarning:transformers(\\.|$)" in config["tool"]["pytest"]["ini_options"]["filterwarnings"]


def test_versions_everywhere_agree_with_the_constraints():
    v = pinned()
    assert {"torch", "transformers", "ray"} <= set(v), v
    image = f"{v['project']}-ray{v['ray']}"
    py = v["python"]
    patterns = {  # what each pattern finds -> the value it must have
        r"\b(torch|transformers|ray)(?:\[[^\]]*\])?==([0-9][\w.]*)": lambda m: (m[2], v[m[1]]),
        r"rayproject/ray:([0-9][\w.]*)-py(\d+)": lambda m: ((m[1], m[2]), (v["ray"], py.replace(".", ""))),
        r"rayVersion: \"?([0-9][\w.]*)": lambda m: (m[1], v["ray"]),
        r"/genrec-batch:([\w.-]+)": lambda m: (m[1], image),
        r"\bpython(3\.\d+) -m venv": lambda m: (m[1], py),
    }
    must_have = {  # the places that install or name versions: each must carry at least these
        "Dockerfile": [
            "-c constraints.txt torch",
            "-c constraints.txt .",
            f"FROM rayproject/ray:{v['ray']}-py{py.replace('.', '')}-gpu",
        ],
        "Makefile": ["-c constraints.txt", "$(PIP) torch", '$(PIP) -e ".[dev,report]"'],
        "infra/cluster/aws-gpu.yaml": [
            "-c ~/genrec-batch/constraints.txt torch",
            "-c ~/genrec-batch/constraints.txt -e ~/genrec-batch",
            f"python{py} -m venv",
        ],
        "infra/kuberay/rayjob-nightly.yaml": [f'rayVersion: "{v["ray"]}"', f"/genrec-batch:{image}"],
        "infra/kuberay/raycronjob-nightly.yaml": [f'rayVersion: "{v["ray"]}"', f"/genrec-batch:{image}"],
    }
    files = sorted(
        {
            ROOT / "Dockerfile",
            ROOT / "Makefile",
            ROOT / "README.md",
            ROOT / ".ci" / "run",
            *(ROOT / "docs").glob("*.md"),
            *(p for p in INFRA.rglob("*") if p.is_file()),
        }
    )
    wrong = []
    for path in files:
        text = path.read_text()
        for pattern, expect in patterns.items():
            for m in re.finditer(pattern, text):
                found, want = expect(m)
                if found != want:
                    wrong.append(f"{path.relative_to(ROOT)}: {m[0]!r}, constraints.txt says {want}")
    assert wrong == []
    missing = [f"{f}: {s!r}" for f, items in must_have.items() for s in items if s not in (ROOT / f).read_text()]
    assert missing == []
    for path in MANIFESTS:
        assert ":latest" not in path.read_text(), path


def test_dockerfile_installs_pinned_torch_then_the_project_and_bakes_in_nothing():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.strip()[:1] not in ("", "#")]
    assert lines[0].startswith("FROM rayproject/ray:") and "WORKDIR /app" in lines
    torch = next(i for i, ln in enumerate(lines) if re.match(r"RUN pip install .*-c constraints.txt torch$", ln))
    project = next(i for i, ln in enumerate(lines) if re.match(r"RUN pip install .*-c constraints.txt \.( |$)", ln))
    assert torch < project
    assert not [ln for ln in lines if ln.split()[0] in ("ENV", "ARG") and re.search("KEY|SECRET|TOKEN", ln)]
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "data/", "models/", "out/", "bench-out/", ".pytest_cache", ".hypothesis"} <= ignored
    assert "constraints.txt" not in ignored


# --- one run per date ---------------------------------------------------------------------------------------------


def test_rayjob_name_is_fixed_per_run_date_and_its_cluster_goes_away_in_minutes():
    (rayjob,) = yaml_docs(INFRA / "kuberay" / "rayjob-nightly.yaml")
    meta, spec = rayjob["metadata"], rayjob["spec"]
    assert "generateName" not in meta and meta["name"] == "genrec-nightly-__RUN_DATE__"
    name = meta["name"].replace("__RUN_DATE__", "2026-11-21")
    assert DNS1035.fullmatch(name) and len(name) <= 47  # KubeRay's RayJob name rules (ValidateRayJobMetadata)
    assert spec["shutdownAfterJobFinishes"] is True and 0 < spec["ttlSecondsAfterFinished"] <= 3600
    assert spec["backoffLimit"] >= 1
    assert "--set run_date=__RUN_DATE__" in spec["entrypoint"] and "--resume latest" in spec["entrypoint"]
    for path in MANIFESTS:
        assert "generateName" not in yaml.safe_dump_all(yaml_docs(path)), path


def test_the_nightly_reads_its_config_from_a_configmap_mounted_where_the_driver_runs():
    """The entrypoint's --config is a file of the ConfigMap genrec-nightly-config, mounted read-only on the head pod
    (a RayJob's driver runs there), and every manifest that creates the RayJob says how to make the ConfigMap."""
    (rayjob,) = yaml_docs(INFRA / "kuberay" / "rayjob-nightly.yaml")
    config = re.search(r"--config (\S+)", rayjob["spec"]["entrypoint"]).group(1)
    folder, name = config.rsplit("/", 1)
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (mount,) = [m for c in head["containers"] for m in c.get("volumeMounts", []) if m["mountPath"] == folder]
    (volume,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
    assert mount.get("readOnly") is True and volume["configMap"]["name"] == "genrec-nightly-config"
    assert "infra/configs" not in rayjob["spec"]["entrypoint"]  # the image keeps only the examples
    made = f"kubectl create configmap genrec-nightly-config --from-file={name}="
    for path in MANIFESTS:
        assert made in path.read_text(), path


def test_raycronjob_runs_the_rayjob_spec_for_its_scheduled_date():
    """The RayCronJob's RayJob is rayjob-nightly.yaml's, its run date the scheduled day: KubeRay's submitter runs the
    entrypoint unquoted in `bash -ce` with RAY_JOB_SUBMISSION_ID = <cron name>-<scheduled minute>-<5 characters>,
    and `--run-date-of` turns it into run_date, whatever day the RayJob (or its retry) starts."""
    from jobs.nightly import parse_args
    from pipeline.config import scheduled_date

    (rayjob,) = yaml_docs(INFRA / "kuberay" / "rayjob-nightly.yaml")
    (cron,) = yaml_docs(INFRA / "kuberay" / "raycronjob-nightly.yaml")
    name, template = cron["metadata"]["name"], cron["spec"]["jobTemplate"]
    assert DNS1035.fullmatch(name) and len(name) <= 36  # KubeRay 1.7: <name>-<minutes> is a valid RayJob name
    assert cron["spec"]["timeZone"] == "Etc/UTC" and template["submissionMode"] == "K8sJobMode"
    entrypoint = template.pop("entrypoint")
    dated = '--run-date-of "$RAY_JOB_SUBMISSION_ID"'
    assert entrypoint == rayjob["spec"]["entrypoint"].replace("--set run_date=__RUN_DATE__", dated)
    assert template == {k: v for k, v in rayjob["spec"].items() if k != "entrypoint"}
    tick = dt.datetime(2026, 11, 26, 2, 0, tzinfo=dt.UTC)
    job_id = f"{name}-{int(tick.timestamp()) // 60}-x7k2q"
    out = subprocess.run(
        ["/bin/bash", "-ce", "--", "printf '%s\\0' " + entrypoint],
        env={"RAY_JOB_SUBMISSION_ID": job_id},
        capture_output=True,
        check=True,
    )
    argv = out.stdout.decode().split("\0")[:-1]
    assert argv[:3] == ["python", "-m", "jobs.nightly"]
    assert scheduled_date(parse_args(argv[3:]).run_date_of) == "2026-11-26"
    assert scheduled_date(f"{name}-{int(tick.timestamp()) // 60 + 22 * 60}-abcde") == "2026-11-27"  # 00:00 next day
    for bad in ("", "genrec-nightly-manual", f"{name}-x7k2q", "raysubmit_7Hh1k"):
        with pytest.raises(ValueError, match="not a RayCronJob's RayJob submission id"):
            scheduled_date(bad)


def launcher_script() -> str:
    (items,) = yaml_docs(INFRA / "kuberay" / "cronjob-nightly.yaml")
    (cronjob,) = [d for d in items["items"] if d["kind"] == "CronJob"]
    (container,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["/bin/sh", "-c"]
    return container["args"][0]


FAKE_KUBECTL = '''#!{python}
"""`kubectl create -f -` against a directory of RayJobs: AlreadyExists as the API server words it."""
import os, sys, yaml
assert sys.argv[1:] == ["create", "-f", "-"], sys.argv
if os.environ.get("FAIL"):
    sys.exit("error: " + os.environ["FAIL"])  # message on stderr, exit code 1
doc = yaml.safe_load(sys.stdin)
name = doc["metadata"]["name"]
path = os.path.join(os.environ["STATE"], name)
if os.path.exists(path):
    sys.exit(f'Error from server (AlreadyExists): error when creating "STDIN": rayjobs.ray.io "{{name}}" already '
             'exists')
with open(path, "w") as f:
    f.write(yaml.safe_dump(doc))
print(f"rayjob.ray.io/{{name}} created")
'''


def test_launcher_creates_tonights_rayjob_once_and_a_second_launch_exits_0(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "state").mkdir()
    kubectl = tmp_path / "bin" / "kubectl"
    kubectl.write_text(FAKE_KUBECTL.format(python=sys.executable))
    kubectl.chmod(0o755)
    script = launcher_script().replace("/manifests/rayjob.yaml", str(INFRA / "kuberay" / "rayjob-nightly.yaml"))
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "STATE": str(tmp_path / "state")}

    def launch(**extra):
        return subprocess.run(
            ["/bin/sh", "-c", script], env={**env, **extra}, capture_output=True, text=True, timeout=30
        )

    today = {dt.datetime.now(dt.UTC).date().isoformat()}
    first = launch()
    today.add(dt.datetime.now(dt.UTC).date().isoformat())
    assert first.returncode == 0, first.stderr
    (created,) = (tmp_path / "state").iterdir()
    date = created.name.removeprefix("genrec-nightly-")
    assert date in today and f"rayjob.ray.io/{created.name} created" in first.stdout
    assert f"--set run_date={date} " in yaml.safe_load(created.read_text())["spec"]["entrypoint"]

    again = launch()  # a retried launcher pod, or a manual launch after the scheduled one
    assert again.returncode == 0, again.stderr
    assert "already exists" in again.stdout and "not starting another" in again.stdout
    assert [p.name for p in (tmp_path / "state").iterdir()] == [created.name]

    down = launch(FAIL="the server is currently unable to handle the request")
    assert down.returncode == 1 and "unable to handle the request" in down.stderr


# --- the cluster launcher's IAM ------------------------------------------------------------------------------------


def test_head_instance_profile_may_pass_the_worker_role():
    cfg = yaml.safe_load(LAUNCHER.read_text())
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]["node_config"]["IamInstanceProfile"]["Name"]
    (worker,) = [t["node_config"]["IamInstanceProfile"]["Name"] for k, t in types.items() if k != cfg["head_node_type"]]
    assert head != worker
    policy = json.loads((INFRA / "cluster" / "head-iam-policy.json").read_text())
    allowed = [s for s in policy["Statement"] if s["Effect"] == "Allow"]
    (pass_role,) = [s for s in allowed if s["Action"] == "iam:PassRole"]
    assert pass_role["Resource"] == f"arn:aws:iam::ACCOUNT_ID:role/{worker}"  # the worker profile's role
    assert pass_role["Condition"]["StringEquals"]["iam:PassedToService"] == "ec2.amazonaws.com"
    ec2 = {a for s in allowed for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert {"ec2:RunInstances", "ec2:TerminateInstances", "ec2:DescribeInstances", "ec2:CreateTags"} <= ec2


def test_the_cluster_launchers_config_fits_its_gpus():
    """The config the cluster launcher submits (infra/cluster/aws-gpu.yaml's comment and infra/README) is sized for its
    workers' GPUs (g5.xlarge: one 24 GB A10G): in docs/sizing.md's estimate its target decodes a whole shard
    (compute.batch_size) per decode, with the precision audit's float32 copies on the GPU."""
    from pipeline.config import load_config
    from pipeline.sizing import sizing_rows

    launcher = LAUNCHER.read_text()
    named = set(re.findall(r"--config (infra/configs/\S+)", launcher))
    named |= set(
        re.findall(r"--config (infra/configs/\S+)", (INFRA / "README.md").read_text().split("aws-gpu.yaml")[-1])
    )
    assert named == {"infra/configs/g5.example.yaml"} and "InstanceType: g5.xlarge" in launcher
    cfg = load_config(str(ROOT / "infra" / "configs" / "g5.example.yaml"))
    size = re.search(r"target-([\d.]+)b/?$", cfg.models.target)[1] + "B"
    (row,) = [r for r in sizing_rows() if (r["model"], r["dtype"], r["gpu_gb"]) == (size, cfg.compute.dtype, 24)]
    assert row["batch"] >= cfg.compute.batch_size and row["audit"] == "GPU"
    assert cfg.compute.cpus_per_actor < 4  # a g5.xlarge has 4 vCPUs: one left for the data tasks


def test_a_stopped_driver_gets_sigterm_and_its_grace_period_before_ray_stops(tmp_path):
    """The RayJob's head (where the driver runs): `ray job stop` waits RAY_JOB_STOP_WAIT_TIME_S before SIGKILL, the
    head's preStop hook sends the driver SIGTERM and waits for it, and the pod's grace period covers both. The hook's
    script, run here against a stand-in driver (its marker renamed, so no real driver on this machine is touched),
    returns only once the driver has exited with its own code."""
    (rayjob,) = yaml_docs(INFRA / "kuberay" / "rayjob-nightly.yaml")
    env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"]
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (container,) = head["containers"]
    python, flag, script = container["lifecycle"]["preStop"]["exec"]["command"]
    assert (python, flag) == ("python", "-c") and '"jobs.nightly"' in script
    assert head["terminationGracePeriodSeconds"] > int(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= 60
    marker = f"genrec-stand-in-{tmp_path.name}"
    stand_in = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: "
            "(time.sleep(1), sys.exit(6)))\nprint('ready', flush=True)\ntime.sleep(60)",
            marker,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert stand_in.stdout.readline() == "ready\n"
    hook = subprocess.run([sys.executable, "-c", script.replace('"jobs.nightly"', repr(marker))], timeout=30)
    assert hook.returncode == 0 and stand_in.poll() == 6  # the hook returned after the driver's own exit


SAPPHIRE_RAPIDS = set(
    "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni "
    "avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8".split()
)


def test_the_kernel_settings_emulate_cpus_that_exist():
    """An AMX CPU (torch's own family avx512): default with oneDNN's SSE41, avx2 with AVX2, and the same CPU without
    AMX; an AVX-512 CPU without AMX and an AVX2 one: each reduced family with its ISA, nothing more. Never a reduced
    ATen family beside the full oneDNN ISA (bfloat16 attention fails there on AMX: pack_vnni2)."""
    from tests.kernels import settings_for

    assert settings_for(SAPPHIRE_RAPIDS, ["default", "avx2"]) == [
        "ATEN_CPU_CAPABILITY=default+ONEDNN_MAX_CPU_ISA=SSE41",
        "ATEN_CPU_CAPABILITY=avx2+ONEDNN_MAX_CPU_ISA=AVX2",
        "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16",
    ]
    zen4 = SAPPHIRE_RAPIDS - {"amx_bf16", "amx_tile", "amx_int8", "avx512_fp16"}
    assert settings_for(zen4, ["default", "avx2"]) == [
        "ATEN_CPU_CAPABILITY=default+ONEDNN_MAX_CPU_ISA=SSE41",
        "ATEN_CPU_CAPABILITY=avx2+ONEDNN_MAX_CPU_ISA=AVX2",
    ]
    assert settings_for({"sse4_2", "avx", "avx2", "fma"}, ["default"]) == [
        "ATEN_CPU_CAPABILITY=default+ONEDNN_MAX_CPU_ISA=SSE41"
    ]
    for setting in settings_for(SAPPHIRE_RAPIDS, ["default", "avx2"]):  # `make test-kernels` splits on +
        assert all(re.fullmatch(r"[A-Z_]+=[A-Za-z0-9_]+", part) for part in setting.split("+")), setting
