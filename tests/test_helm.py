"""The Helm chart, checked offline: lint, render, validate, and the behaviour it promises.

Every manifest `helm template` renders (default values, the GPU-and-CPU example, external
services) is validated against the Kubernetes JSON schemas that the `kubernetes-validate`
package ships (strict: unknown fields are errors). Then the chart's promises: one worker
Deployment per pool with its node selector and fingerprint, credentials only in Secrets,
bundled services gone when disabled, a values schema that rejects bad values, and a
worker grace period longer than the compile hard time limit.

Needs the `helm` binary: `scripts/install-helm` builds it. Without it these tests fail
(they never skip: a skipped deployment check in CI reads as a pass).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from farm.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kernel-farm"
EXAMPLE = ROOT / "helm" / "examples" / "gpu-and-cpu.yaml"
DOCKER = ROOT / "docker"
RELEASE = "farm"
NAMESPACE = "kernel-farm"
FULLNAME = "farm-kernel-farm"  # <release>-<chart>
KUBE_VERSION = "1.29.0"  # schemas shipped by kubernetes-validate; also helm's --kube-version
EXISTING_SECRET = "farm-credentials"

# Credentials given as values in the "given-secrets" scenario: each must end up in the
# Secret and nowhere else.
GIVEN_SECRETS = {
    "redisPassword": "redis-pw-Q7x9LmT2vK",
    "minioAccessKey": "minio-user-H3pZ8w",
    "minioSecretKey": "minio-secret-N4bV6cR1yU8j",
    "postgresPassword": "pg-pw-W5sE2dF7gH",
}

EXTERNAL_VALUES: dict[str, Any] = {
    "redis": {"enabled": False},
    "minio": {"enabled": False, "endpoint": "https://minio.example.com", "bucket": "farm-art"},
    "postgresql": {"enabled": False},
    "secrets": {"existingSecret": EXISTING_SECRET},
}

SCENARIOS: dict[str, dict[str, Any] | Path | None] = {
    "default": None,
    "example": EXAMPLE,
    "external": EXTERNAL_VALUES,
    "given-secrets": {"secrets": GIVEN_SECRETS},
}

# Environment variables that carry credentials: always valueFrom.secretKeyRef.
CREDENTIAL_ENV = {
    "FARM_REDIS_URL", "FARM_MINIO_ACCESS_KEY", "FARM_MINIO_SECRET_KEY", "FARM_RECORDS_URL",
    "REDIS_PASSWORD", "REDISCLI_AUTH", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD",
    "POSTGRES_PASSWORD",
}

HELP = "helm is not installed: run scripts/install-helm (builds it with `go install`)"


# -- helm -------------------------------------------------------------------------------


def _go_bin_helm() -> Path | None:
    go = shutil.which("go")
    if go is None:
        return None
    env = subprocess.run([go, "env", "GOBIN", "GOPATH"], capture_output=True, text=True,
                         timeout=60, check=False)
    if env.returncode != 0:
        return None
    gobin, gopath = [*env.stdout.splitlines(), "", ""][:2]
    folder = Path(gobin) if gobin else Path(gopath.split(os.pathsep)[0]) / "bin"
    return folder / "helm"


@cache
def helm_binary() -> str | None:
    """helm on PATH, else where scripts/install-helm puts it (Go's bin folder)."""
    found = shutil.which("helm")
    if found:
        return found
    candidate = _go_bin_helm()
    if candidate is not None and os.access(candidate, os.X_OK):
        return str(candidate)
    return None


@pytest.fixture(scope="session")
def helm_bin() -> str:
    found = helm_binary()
    if found is None:
        pytest.fail(HELP, pytrace=False)
    return found


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    found = helm_binary()
    if found is None:
        pytest.fail(HELP, pytrace=False)
    # helm needs no repositories here: keep it off the user's helm folders.
    home = Path(tempfile.gettempdir()) / "kernel-farm-helm"
    env = {**os.environ, **{f"HELM_{kind}_HOME": str(home / kind.lower())
                            for kind in ("CACHE", "CONFIG", "DATA")}}
    return subprocess.run([found, *args], capture_output=True, text=True, timeout=120,
                          check=False, env=env, cwd=ROOT)


def values_args(values: dict[str, Any] | Path | None, tmp: Path, name: str) -> list[str]:
    if values is None:
        return []
    if isinstance(values, Path):
        return ["-f", str(values)]
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["-f", str(path)]


def template(values: dict[str, Any] | Path | None, tmp: Path,
             name: str = "values") -> subprocess.CompletedProcess[str]:
    return run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                    "--kube-version", KUBE_VERSION, *values_args(values, tmp, name))


def parse(stdout: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(stdout) if doc]


@pytest.fixture(scope="session")
def rendered(helm_bin: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Each scenario's manifests, rendered once."""
    tmp = tmp_path_factory.mktemp("values")
    out: dict[str, list[dict]] = {}
    for name, values in SCENARIOS.items():
        result = template(values, tmp, name)
        assert result.returncode == 0, f"helm template ({name}) failed:\n{result.stderr}"
        out[name] = parse(result.stdout)
        assert out[name], f"helm template ({name}) rendered nothing"
    return out


# -- helpers over manifests --------------------------------------------------------------


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def workers(docs: list[dict]) -> list[dict]:
    return [d for d in of_kind(docs, "Deployment")
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]


def pod_specs(docs: list[dict]) -> Iterator[tuple[str, dict]]:
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def containers(docs: list[dict]) -> Iterator[tuple[str, dict]]:
    for name, spec in pod_specs(docs):
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            yield f"{name}/{c['name']}", c


def secret_values(docs: list[dict]) -> dict[str, str]:
    out = {}
    for secret in of_kind(docs, "Secret"):
        for key, value in secret.get("data", {}).items():
            out[key] = base64.b64decode(value).decode()
        out.update(secret.get("stringData", {}))
    return out


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def chart_values(scenario: str) -> dict[str, Any]:
    """The effective values of a scenario: chart defaults overlaid with its file."""
    base = yaml.safe_load((CHART / "values.yaml").read_text())
    extra = SCENARIOS[scenario]
    if isinstance(extra, Path):
        extra = yaml.safe_load(extra.read_text())
    return _merge(base, extra or {})


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


# -- lint and schema validation ----------------------------------------------------------


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_helm_lint(scenario: str, helm_bin: str, tmp_path: Path) -> None:
    result = run_helm("lint", "--strict", str(CHART),
                      *values_args(SCENARIOS[scenario], tmp_path, scenario))
    assert result.returncode == 0, f"helm lint ({scenario}):\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_manifests_match_kubernetes_schemas(scenario: str,
                                            rendered: dict[str, list[dict]]) -> None:
    problems = []
    for doc in rendered[scenario]:
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{doc['kind']} {doc['metadata']['name']}: {exc.message}")
    assert not problems, "\n".join(problems)


def test_validation_is_not_vacuous(rendered: dict[str, list[dict]]) -> None:
    """The schemas do catch a misspelled field and a wrong type in our manifests."""
    worker = workers(rendered["default"])[0]
    typo = json.loads(json.dumps(worker))
    typo["spec"]["template"]["spec"]["nodeSelektor"] = {"a": "b"}
    wrong_type = json.loads(json.dumps(worker))
    wrong_type["spec"]["replicas"] = "two"
    for broken in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


# -- worker pools ------------------------------------------------------------------------


def test_one_worker_deployment_per_pool(rendered: dict[str, list[dict]]) -> None:
    pools = chart_values("example")["workers"]["pools"]
    deployments = workers(rendered["example"])
    assert sorted(d["metadata"]["name"] for d in deployments) == \
        sorted(f"{FULLNAME}-worker-{p['name']}" for p in pools)
    for pool in pools:
        dep = named(deployments, "Deployment", f"{FULLNAME}-worker-{pool['name']}")
        spec = dep["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == pool["nodeSelector"]
        assert spec.get("tolerations", []) == pool.get("tolerations", [])
        assert dep["spec"]["replicas"] == pool["replicas"]
        (container,) = spec["containers"]
        args = container["args"]
        assert flag(args, "--fingerprint") == pool["fingerprint"]
        assert flag(args, "--concurrency") == str(pool["concurrency"])
        # The image runs `farm worker`; the chart passes arguments only.
        assert "command" not in container
        limits = container["resources"]["limits"]
        if pool["type"] == "nvidia":
            assert "worker-nvidia" in container["image"]
            assert limits["nvidia.com/gpu"] == pool.get("gpus", 1)
            assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
        else:
            assert "worker-cpu" in container["image"]
            assert "nvidia.com/gpu" not in limits
        # Pods of different pools never share a selector.
        assert dep["spec"]["selector"]["matchLabels"]["kernel-farm/pool"] == pool["name"]


def test_default_pool_serves_the_first_device(rendered: dict[str, list[dict]]) -> None:
    (dep,) = workers(rendered["default"])
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--fingerprint" not in container["args"]
    assert flag(container["args"], "--concurrency") == "2"
    assert dep["spec"]["template"]["spec"]["nodeSelector"]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_grace_period_exceeds_the_hard_time_limit(scenario: str,
                                                  rendered: dict[str, list[dict]]) -> None:
    config = named(rendered[scenario], "ConfigMap", FULLNAME)["data"]
    hard = float(config["FARM_COMPILE_HARD_TIME_LIMIT"])
    assert float(config["FARM_VISIBILITY_TIMEOUT"]) > hard
    assert workers(rendered[scenario])
    for dep in workers(rendered[scenario]):
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > hard


# -- credentials -------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_credentials_come_only_from_secrets(scenario: str,
                                            rendered: dict[str, list[dict]]) -> None:
    docs = rendered[scenario]
    secret_name = EXISTING_SECRET if scenario == "external" else FULLNAME
    for where, container in containers(docs):
        assert not any(re.search(r"pass|secret|key|url", a, re.I)
                       for a in container.get("args", []) if a.startswith("--")), where
        for env in container.get("env", []):
            if env["name"] in CREDENTIAL_ENV:
                assert "value" not in env, f"{where}: {env['name']} is a plain value"
                ref = env["valueFrom"]["secretKeyRef"]
                assert ref["name"] == secret_name, where
    for config in of_kind(docs, "ConfigMap"):
        for key in config["data"]:
            assert not re.search(r"PASSWORD|SECRET|ACCESS_KEY|_URL$", key), key
    # No credential the chart stored appears in any other manifest, in any form.
    values = [v for v in secret_values(docs).values() if len(v) >= 6]
    others = json.dumps([d for d in docs if d["kind"] != "Secret"])
    for value in values:
        assert value not in others
        assert base64.b64encode(value.encode()).decode() not in others


def test_given_credentials_land_in_the_secret(rendered: dict[str, list[dict]]) -> None:
    data = secret_values(rendered["given-secrets"])
    assert data["redis-password"] == GIVEN_SECRETS["redisPassword"]
    assert data["minio-access-key"] == GIVEN_SECRETS["minioAccessKey"]
    assert data["minio-secret-key"] == GIVEN_SECRETS["minioSecretKey"]
    assert data["postgres-password"] == GIVEN_SECRETS["postgresPassword"]
    assert data["redis-url"] == \
        f"redis://:{GIVEN_SECRETS['redisPassword']}@{FULLNAME}-redis:6379/0"
    assert data["records-url"] == (f"postgresql+psycopg://farm:{GIVEN_SECRETS['postgresPassword']}"
                                   f"@{FULLNAME}-postgresql:5432/farm")


def test_generated_credentials_are_consistent(rendered: dict[str, list[dict]]) -> None:
    data = secret_values(rendered["default"])
    assert len(data["redis-password"]) >= 32 and len(data["minio-secret-key"]) >= 32
    assert f":{data['redis-password']}@" in data["redis-url"]
    assert f":{data['postgres-password']}@" in data["records-url"]


@pytest.mark.parametrize("scenario", ["default", "example", "given-secrets"])
def test_settings_read_the_rendered_environment(scenario: str,
                                                rendered: dict[str, list[dict]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """farm/settings.py accepts every FARM_* variable the chart sets, with its value."""
    docs = rendered[scenario]
    farm = chart_values(scenario)["farm"]
    config = named(docs, "ConfigMap", FULLNAME)["data"]
    secrets = secret_values(docs)
    env: dict[str, str] = dict(config)
    for _, container in containers(docs):
        for item in container.get("env", []):
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            if item["name"].startswith("FARM_") and ref:
                env[item["name"]] = secrets[ref["key"]]
    known = {f"FARM_{field.upper()}" for field in Settings.model_fields}
    assert {k for k in env if k.startswith("FARM_")} <= known
    for key in list(os.environ):
        if key.startswith("FARM_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.redis_url == secrets["redis-url"]
    assert settings.minio_endpoint == f"{FULLNAME}-minio:9000"
    assert settings.minio_secret_key is not None
    assert settings.minio_secret_key.get_secret_value() == secrets["minio-secret-key"]
    assert settings.records_url == secrets["records-url"]
    assert settings.compile_hard_time_limit == farm["compileHardTimeLimit"]
    assert settings.visibility_timeout == farm["visibilityTimeout"]
    assert settings.keep_sessions == farm["keepSessions"]
    assert settings.records_level == farm["recordsLevel"]
    assert settings.family_modules == farm["familyModules"]


# -- bundled or external services --------------------------------------------------------


def test_bundled_services_by_default(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["default"]
    for service in ("redis", "minio", "postgresql"):
        sts = named(docs, "StatefulSet", f"{FULLNAME}-{service}")
        assert sts["spec"]["volumeClaimTemplates"], service
        named(docs, "Service", f"{FULLNAME}-{service}")
    redis = named(docs, "StatefulSet", f"{FULLNAME}-redis")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert "--appendonly yes" in " ".join(container["args"])
    named(docs, "Deployment", f"{FULLNAME}-ingester")


def test_external_services_leave_no_bundled_ones(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["external"]
    assert not of_kind(docs, "StatefulSet")
    assert not of_kind(docs, "Secret"), "existingSecret given: the chart makes no Secret"
    services = [d["metadata"]["name"] for d in of_kind(docs, "Service")]
    assert services == []
    assert not [c for _, c in containers(docs)
                if any(x in c["image"] for x in ("redis", "minio", "postgres"))]
    config = named(docs, "ConfigMap", FULLNAME)["data"]
    assert config["FARM_MINIO_ENDPOINT"] == "https://minio.example.com"
    assert config["FARM_MINIO_BUCKET"] == "farm-art"
    ingester = named(docs, "Deployment", f"{FULLNAME}-ingester")
    (container,) = ingester["spec"]["template"]["spec"]["containers"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert refs["FARM_RECORDS_URL"] == {"name": EXISTING_SECRET, "key": "records-url"}
    assert refs["FARM_REDIS_URL"] == {"name": EXISTING_SECRET, "key": "redis-url"}


def test_external_services_with_a_chart_secret(helm_bin: str, tmp_path: Path) -> None:
    values = json.loads(json.dumps(EXTERNAL_VALUES))
    values["secrets"] = {"redisUrl": "rediss://:pw-Zq81@redis.example.com:6380/0",
                         "recordsUrl": "postgresql+psycopg://farm:pw-Yx72@pg.example.com/farm",
                         "minioAccessKey": "farm-user", "minioSecretKey": "sk-Wv63Ut54"}
    result = template(values, tmp_path)
    assert result.returncode == 0, result.stderr
    docs = parse(result.stdout)
    assert secret_values(docs) == {"redis-url": values["secrets"]["redisUrl"],
                                   "records-url": values["secrets"]["recordsUrl"],
                                   "minio-access-key": "farm-user",
                                   "minio-secret-key": "sk-Wv63Ut54"}
    assert not of_kind(docs, "StatefulSet")
    # Without the external Redis URL the chart refuses to render, and says what to set.
    del values["secrets"]["redisUrl"]
    result = template(values, tmp_path)
    assert result.returncode != 0 and "secrets.redisUrl" in result.stderr


# -- values the chart refuses ------------------------------------------------------------

# Values the values schema refuses: `helm lint` and `helm template` both fail.
SCHEMA_REFUSES: dict[str, tuple[dict[str, Any], str]] = {
    "concurrency-many": (
        {"workers": {"pools": [{"name": "cpu", "concurrency": "many"}]}}, "concurrency"),
    "pool-name-not-dns": (
        {"workers": {"pools": [{"name": "GPU_pool", "concurrency": 2}]}}, "name"),
    "unknown-pool-type": (
        {"workers": {"pools": [{"name": "x", "type": "amd", "concurrency": 2}]}}, "type"),
    "records-level": ({"farm": {"recordsLevel": "verbose"}}, "recordsLevel"),
    "misspelled-key": ({"wrokers": {}}, "wrokers"),
}

# Values the templates refuse (they compare values, which a JSON schema cannot): `helm
# template` and install fail with the message; `helm lint` only reports them as INFO.
TEMPLATES_REFUSE: dict[str, tuple[dict[str, Any], str]] = {
    "visibility-below-hard-limit": (
        {"farm": {"visibilityTimeout": 300}}, "visibilityTimeout"),
    "grace-below-hard-limit": (
        {"workers": {"pools": [{"name": "cpu", "concurrency": 2,
                                "terminationGracePeriodSeconds": 60}]}},
        "terminationGracePeriodSeconds"),
    "duplicate-pool": (
        {"workers": {"pools": [{"name": "a", "concurrency": 1},
                               {"name": "a", "concurrency": 2}]}}, "used twice"),
    "nvidia-without-fingerprint": (
        {"workers": {"pools": [{"name": "g", "type": "nvidia", "concurrency": 2}]}},
        "fingerprint"),
    "external-minio-without-endpoint": (
        {"minio": {"enabled": False}, "secrets": {"existingSecret": "x"}}, "minio.endpoint"),
}


@pytest.mark.parametrize("case", list(SCHEMA_REFUSES))
def test_values_schema_refuses_bad_values(case: str, helm_bin: str, tmp_path: Path) -> None:
    values, mention = SCHEMA_REFUSES[case]
    result = template(values, tmp_path)
    assert result.returncode != 0, f"helm template accepted {values}"
    assert "schema" in result.stderr and mention in result.stderr, result.stderr
    lint = run_helm("lint", str(CHART), *values_args(values, tmp_path, "lint"))
    assert lint.returncode != 0, f"helm lint accepted {values}"
    assert mention in lint.stdout + lint.stderr


@pytest.mark.parametrize("case", list(TEMPLATES_REFUSE))
def test_templates_refuse_inconsistent_values(case: str, helm_bin: str,
                                              tmp_path: Path) -> None:
    values, mention = TEMPLATES_REFUSE[case]
    result = template(values, tmp_path)
    assert result.returncode != 0, f"helm template accepted {values}"
    assert mention in result.stderr, result.stderr


# -- the images the chart runs -----------------------------------------------------------


def dockerfile(name: str) -> dict[str, list[str]]:
    """Instructions of a Dockerfile (continuations joined, comments dropped)."""
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", (DOCKER / name).read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.setdefault(word.upper(), []).append(rest.strip())
    return out


@pytest.mark.parametrize(("name", "command"), [
    ("worker-cpu.Dockerfile", ["farm", "worker"]),
    ("worker-nvidia.Dockerfile", ["farm", "worker"]),
    ("ingester.Dockerfile", ["farm", "ingest"]),
])
def test_images_fit_the_chart(name: str, command: list[str]) -> None:
    """The chart passes arguments only and runs as uid 10001: the images must agree."""
    instructions = dockerfile(name)
    entrypoint = json.loads(instructions["ENTRYPOINT"][-1])
    assert entrypoint[-2:] == command
    assert instructions["USER"][-1].split(":")[0] == "10001"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001
    if name == "worker-nvidia.Dockerfile":
        run = " ".join(instructions["RUN"])
        assert "libnvidia-opencl.so.1" in run and "/etc/OpenCL/vendors/nvidia.icd" in run
        assert any("NVIDIA_DRIVER_CAPABILITIES=compute,utility" in e
                   for e in instructions["ENV"])
    if name == "worker-cpu.Dockerfile":
        assert instructions["FROM"][0].startswith("python:3.11-slim")
        run = " ".join(instructions["RUN"])
        assert '".[all]"' in run
        # PoCL links each kernel with the system `ld` against -lgcc -lgcc_s -lc.
        assert "gcc" in run.split() and "libc6-dev" in run.split()
