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
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pydantic
import pytest
import yaml

from farm.core.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kernel-farm"
EXAMPLES = sorted((ROOT / "helm" / "examples").glob("*.yaml"))
EXAMPLE = ROOT / "helm" / "examples" / "gpu-and-cpu.yaml"
DOCKER = ROOT / "docker"
RELEASE = "farm"
NAMESPACE = "kernel-farm"
FULLNAME = "farm-kernel-farm"  # <release>-<chart>
KUBE_VERSION = "1.29.0"  # helm's --kube-version
# The oldest and the newest Kubernetes whose schemas kubernetes-validate ships: every
# rendered manifest is validated against both.
KUBE_VERSIONS = sorted({min(kubernetes_validate.utils.all_versions(),
                            key=lambda v: tuple(int(x) for x in v.split("."))),
                        kubernetes_validate.latest_version()},
                       key=lambda v: tuple(int(x) for x in v.split(".")))
# Custom resources (KEDA, prometheus-operator): no schemas in kubernetes-validate, so
# their tests below check the fields the operators read.
CUSTOM_KINDS = {"ScaledObject", "TriggerAuthentication", "ServiceMonitor", "PrometheusRule"}
# APIs `helm template` is told the cluster serves (so the chart renders KEDA objects).
API_VERSIONS = ["keda.sh/v1alpha1", "monitoring.coreos.com/v1"]
EXISTING_SECRET = "farm-credentials"

# Credentials given as values in the "default" scenario (the chart's defaults plus the
# credentials: under `helm template` the chart generates none): each must end up in the
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

# Signing keys and a private CA from Secrets (issue 19 item 6).
SIGNING_SECRET = "farm-signing"
CA_SECRET = "farm-private-ca"
SIGNED_VALUES: dict[str, Any] = {
    "secrets": {"existingSecret": EXISTING_SECRET},
    "signing": {"existingSecret": SIGNING_SECRET},
    "caBundle": {"existingSecret": CA_SECRET},
}

SCENARIOS: dict[str, dict[str, Any] | Path | None] = {
    "default": {"secrets": GIVEN_SECRETS},
    "external": EXTERNAL_VALUES,
    "signed-private-ca": SIGNED_VALUES,
    **{f"example-{path.stem}": path for path in EXAMPLES},
}
EXAMPLE_SCENARIO = "example-gpu-and-cpu"

# Environment variables that carry credentials: always valueFrom.secretKeyRef.
CREDENTIAL_ENV = {
    "FARM_REDIS_URL", "FARM_MINIO_ACCESS_KEY", "FARM_MINIO_SECRET_KEY", "FARM_RECORDS_URL",
    "REDIS_PASSWORD", "REDISCLI_AUTH", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD",
    "POSTGRES_PASSWORD", "FARM_SIGNING_KEY",
}

HEALTH_DIR = "/tmp/farm-health"  # FARM_HEALTH_DIR in the ConfigMap; the probes read it

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


def template(values: dict[str, Any] | Path | None, tmp: Path, name: str = "values",
             apis: list[str] = API_VERSIONS) -> subprocess.CompletedProcess[str]:
    api_args = [arg for api in apis for arg in ("--api-versions", api)]
    return run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                    "--kube-version", KUBE_VERSION, *api_args,
                    *values_args(values, tmp, name))


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


def pod_specs(docs: list[dict], *, every: bool = False) -> Iterator[tuple[str, dict]]:
    """Pod specs of the Deployments and StatefulSets (``every``: Jobs and Pods too)."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet") or (every and doc["kind"] == "Job"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]
        elif every and doc["kind"] == "Pod":
            yield doc["metadata"]["name"], doc["spec"]


def containers(docs: list[dict], *, every: bool = False) -> Iterator[tuple[str, dict]]:
    for name, spec in pod_specs(docs, every=every):
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


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_manifests_match_kubernetes_schemas(scenario: str, version: str,
                                            rendered: dict[str, list[dict]]) -> None:
    problems = []
    checked = 0
    for doc in rendered[scenario]:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
            checked += 1
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{doc['kind']} {doc['metadata']['name']}: {exc.message}")
    assert not problems, "\n".join(problems)
    assert checked >= 10


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
    pools = chart_values(EXAMPLE_SCENARIO)["workers"]["pools"]
    deployments = workers(rendered[EXAMPLE_SCENARIO])
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
    values = chart_values(scenario)
    secret_name = values["secrets"]["existingSecret"] or FULLNAME
    allowed = {secret_name, values["signing"]["existingSecret"]}
    for where, container in containers(docs, every=True):
        assert not any(re.search(r"pass|secret|key|url", a, re.I)
                       for a in container.get("args", []) if a.startswith("--")), where
        for env in container.get("env", []):
            if env["name"] in CREDENTIAL_ENV or "valueFrom" in env:
                assert "value" not in env, f"{where}: {env['name']} is a plain value"
                ref = env["valueFrom"]["secretKeyRef"]
                assert ref["name"] in allowed, where
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
    data = secret_values(rendered["default"])
    assert data["redis-password"] == GIVEN_SECRETS["redisPassword"]
    assert data["minio-access-key"] == GIVEN_SECRETS["minioAccessKey"]
    assert data["minio-secret-key"] == GIVEN_SECRETS["minioSecretKey"]
    assert data["postgres-password"] == GIVEN_SECRETS["postgresPassword"]
    assert data["redis-url"] == \
        f"redis://:{GIVEN_SECRETS['redisPassword']}@{FULLNAME}-redis:6379/0"
    assert data["records-url"] == (f"postgresql+psycopg://farm:{GIVEN_SECRETS['postgresPassword']}"
                                   f"@{FULLNAME}-postgresql:5432/farm")


def test_generated_credentials_need_a_cluster(helm_bin: str, tmp_path: Path) -> None:
    """Under `helm template` lookup finds nothing: a generated password would change on
    every render (Argo CD, Flux), so the chart refuses and says what to set."""
    for values in (None, {"secrets": {**GIVEN_SECRETS, "postgresPassword": ""}}):
        result = template(values, tmp_path)
        assert result.returncode != 0, "rendered credentials that change on every render"
        assert "secrets.existingSecret" in result.stderr, result.stderr
        assert "helm template" in result.stderr
    missing_pg = template({"secrets": {**GIVEN_SECRETS, "postgresPassword": ""}}, tmp_path)
    assert "secrets.postgresPassword is empty" in missing_pg.stderr


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_secrets_and_pods_are_stable_across_renders(scenario: str, helm_bin: str,
                                                   tmp_path: Path,
                                                   rendered: dict[str, list[dict]]) -> None:
    """A second render is identical: no credential or checksum rotates on a GitOps sync."""
    again = template(SCENARIOS[scenario], tmp_path, scenario)
    assert again.returncode == 0, again.stderr
    assert parse(again.stdout) == rendered[scenario]
    secrets = of_kind(rendered[scenario], "Secret")
    if chart_values(scenario)["secrets"]["existingSecret"]:
        assert not secrets
    else:
        (secret,) = secrets
        assert secret["data"]["redis-password"]


def test_pods_carry_a_checksum_of_the_secret(helm_bin: str, tmp_path: Path,
                                             rendered: dict[str, list[dict]]) -> None:
    """Env from a Secret is read at start only: new credentials must roll the pods."""
    def checksums(docs: list[dict]) -> dict[str, str]:
        return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"]
                ["checksum/secret"] for d in of_kind(docs, "Deployment")}

    before = checksums(rendered["default"])
    assert len(before) == 2 and all(before.values())
    rotated = template({"secrets": {**GIVEN_SECRETS, "redisPassword": "another-pw-Zz91"}},
                       tmp_path)
    assert rotated.returncode == 0, rotated.stderr
    after = checksums(parse(rotated.stdout))
    assert after.keys() == before.keys()
    assert all(after[name] != before[name] for name in before)


@pytest.mark.parametrize("scenario", ["default"])
def test_settings_read_the_rendered_environment(scenario: str,
                                                rendered: dict[str, list[dict]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """farm/core/settings.py accepts every FARM_* variable the chart sets, with its value."""
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
    # the pool's own MinIO user, not the root (issue 19 item 5)
    assert settings.minio_secret_key.get_secret_value() == secrets["minio-pool-cpu-secret-key"]
    assert settings.minio_secret_key.get_secret_value() != secrets["minio-secret-key"]
    assert settings.records_url == secrets["records-url"]
    assert settings.compile_hard_time_limit == farm["compileHardTimeLimit"]
    assert settings.visibility_timeout == farm["visibilityTimeout"]
    assert settings.keep_sessions == farm["keepSessions"]
    assert settings.records_level == farm["recordsLevel"]
    assert settings.family_modules == farm["familyModules"]
    assert settings.worker_events and settings.worker_heartbeat
    assert settings.metrics_port == chart_values(scenario)["metrics"]["port"]
    # the farm listens on loopback unless told; a pod is scraped on its own address
    assert settings.metrics_address == "0.0.0.0"
    assert str(settings.health_dir) == HEALTH_DIR


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
    assert sorted(services) == [f"{FULLNAME}-ingester-metrics", f"{FULLNAME}-worker-metrics"]
    assert not of_kind(docs, "Job"), "an external MinIO's users are the operator's to make"
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
                         "minioPools": {"cpu": {"accessKey": "farm-pool-cpu",
                                                "secretKey": "sk-Pp41Qq52"}},
                         "minioReader": {"accessKey": "farm-reader",
                                         "secretKey": "sk-Rr63Ss74"}}
    result = template(values, tmp_path)
    assert result.returncode == 0, result.stderr
    docs = parse(result.stdout)
    assert secret_values(docs) == {"redis-url": values["secrets"]["redisUrl"],
                                   "records-url": values["secrets"]["recordsUrl"],
                                   "minio-pool-cpu-access-key": "farm-pool-cpu",
                                   "minio-pool-cpu-secret-key": "sk-Pp41Qq52",
                                   "minio-reader-access-key": "farm-reader",
                                   "minio-reader-secret-key": "sk-Rr63Ss74"}
    # A pool without credentials of its own: the chart refuses and says where to look.
    del values["secrets"]["minioPools"]
    result = template(values, tmp_path)
    assert result.returncode != 0 and "secrets.minioPools.cpu" in result.stderr
    assert "docs/DEPLOY.md" in result.stderr
    # Without per-pool credentials the farm's one MinIO key is needed, as before.
    values["minio"]["perPoolCredentials"] = False
    values["secrets"].update(minioAccessKey="farm-user", minioSecretKey="sk-Wv63Ut54")
    result = template(values, tmp_path)
    assert result.returncode == 0, result.stderr
    assert secret_values(parse(result.stdout))["minio-access-key"] == "farm-user"
    values["secrets"]["minioPools"] = {"cpu": {"accessKey": "farm-pool-cpu",
                                               "secretKey": "sk-Pp41Qq52"}}
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
    "digest-not-sha256": (
        {"images": {"workerCpu": {"repository": "r/w", "digest": "latest"}}}, "digest"),
    "autoscaling-typo": (
        {"workers": {"pools": [{"name": "cpu", "concurrency": 2,
                                "autoscaling": {"enabled": True, "maxReplica": 3}}]}},
        "maxReplica"),
    "metrics-port-privileged": ({"metrics": {"enabled": True, "port": 80}}, "port"),
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
    "autoscaling-without-fingerprint": (
        {"workers": {"pools": [{"name": "cpu", "concurrency": 2,
                                "autoscaling": {"enabled": True, "maxReplicas": 3}}]}},
        "set the pool's fingerprint"),
    "autoscaling-min-above-max": (
        {"workers": {"pools": [{"name": "cpu", "concurrency": 2, "fingerprint": "pocl-x",
                                "autoscaling": {"enabled": True, "minReplicas": 5,
                                                "maxReplicas": 3}}]}},
        "exceeds maxReplicas"),
    "keda-external-redis-without-address": (
        {"redis": {"enabled": False}, "secrets": {"existingSecret": "x"},
         "workers": {"pools": [{"name": "cpu", "concurrency": 2, "fingerprint": "pocl-x",
                                "autoscaling": {"enabled": True, "maxReplicas": 3}}]}},
        "autoscaling.keda.redis.address"),
    "helm-test-unknown-pool": ({"helmTest": {"pool": "gpu"}}, "helmTest.pool"),
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
    values = {"secrets": GIVEN_SECRETS, **values}  # fail for this reason, not credentials
    result = template(values, tmp_path)
    assert result.returncode != 0, f"helm template accepted {values}"
    assert mention in result.stderr, result.stderr


# -- operations: probes, disruption budgets, autoscaling, network, metrics ---------------


def farm_pods(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(Deployment, its container) for every worker pool and the ingester."""
    return [(d, d["spec"]["template"]["spec"]["containers"][0])
            for d in of_kind(docs, "Deployment")]


def _probe_command(container: dict, probe: str) -> list[str]:
    return list(container[probe]["exec"]["command"])


def _run_probe(command: list[str], health: Path) -> int:
    """Run a probe's command here, against a health folder of our own."""
    local = [part.replace(HEALTH_DIR, str(health)) for part in command]
    return subprocess.run(local, capture_output=True, timeout=30, check=False).returncode


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_probes_read_the_health_files(scenario: str, rendered: dict[str, list[dict]],
                                      tmp_path: Path) -> None:
    """Every worker and ingester pod has startup, readiness and liveness probes, and they
    do what they promise against the files farm/cluster/health.py writes."""
    from farm.cluster.health import HealthFiles

    docs = rendered[scenario]
    assert named(docs, "ConfigMap", FULLNAME)["data"]["FARM_HEALTH_DIR"] == HEALTH_DIR
    pods = farm_pods(docs)
    assert len(pods) >= 2
    for dep, container in pods:
        where = dep["metadata"]["name"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in container, f"{where}: no {probe}"
        health = HealthFiles(tmp_path / where)
        ready = _probe_command(container, "readinessProbe")
        alive = _probe_command(container, "livenessProbe")
        assert _probe_command(container, "startupProbe") == ready
        assert _run_probe(ready, health.folder) != 0, f"{where}: ready before it started"
        assert _run_probe(alive, health.folder) != 0, f"{where}: alive with no heartbeat"
        health.ready()
        health.alive()
        assert _run_probe(ready, health.folder) == 0, where
        assert _run_probe(alive, health.folder) == 0, where
        stale = time.time() - 3600
        os.utime(health.folder / "alive", (stale, stale))
        assert _run_probe(alive, health.folder) != 0, f"{where}: alive on a stale heartbeat"
        health.not_ready()
        assert _run_probe(ready, health.folder) != 0, where
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 60, where


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions In) selects ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def pod_labels(doc: dict) -> dict[str, str]:
    if doc["kind"] == "Pod":
        return dict(doc["metadata"]["labels"])
    return dict(doc["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_disruption_budget_per_pool(scenario: str, rendered: dict[str, list[dict]]) -> None:
    docs = rendered[scenario]
    budgets = of_kind(docs, "PodDisruptionBudget")
    pools = chart_values(scenario)["workers"]["pools"]
    for pool in pools:
        pdb = named(budgets, "PodDisruptionBudget", f"{FULLNAME}-worker-{pool['name']}")
        chosen = [d["metadata"]["name"] for d in of_kind(docs, "Deployment")
                  if _selects(pdb["spec"]["selector"], pod_labels(d))]
        assert chosen == [f"{FULLNAME}-worker-{pool['name']}"]
        assert pdb["spec"]["maxUnavailable"] == \
            pool.get("podDisruptionBudget", {}).get("maxUnavailable", 1)
    ingester = chart_values(scenario)["ingester"]
    has_ingester_pdb = any(p["metadata"]["name"] == f"{FULLNAME}-ingester" for p in budgets)
    assert has_ingester_pdb == (ingester["enabled"] and ingester["replicas"] > 1)


def test_keda_scales_each_pool_on_its_queue(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["example-autoscaling-keda"]
    values = chart_values("example-autoscaling-keda")
    scaled = of_kind(docs, "ScaledObject")
    assert len(scaled) == len(values["workers"]["pools"])
    (auth,) = of_kind(docs, "TriggerAuthentication")
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "password", "name": values["secrets"]["existingSecret"],
         "key": "redis-password"}]
    for pool in values["workers"]["pools"]:
        name = f"{FULLNAME}-worker-{pool['name']}"
        so = named(scaled, "ScaledObject", name)
        dep = named(docs, "Deployment", name)
        assert so["spec"]["scaleTargetRef"] == {"name": name}
        assert "replicas" not in dep["spec"], "a fixed replica count would fight KEDA"
        assert so["spec"]["minReplicaCount"] == pool["autoscaling"]["minReplicas"]
        assert so["spec"]["maxReplicaCount"] == pool["autoscaling"]["maxReplicas"]
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "redis"
        meta = trigger["metadata"]
        assert meta["listName"] == f"farm.{pool['fingerprint']}"
        # KEDA resolves the address in its own namespace: a short name would not reach
        # the bundled Redis (issue 19 item 7)
        assert meta["address"] == f"{FULLNAME}-redis.{NAMESPACE}.svc.cluster.local:6379"
        assert meta["listLength"] == str(pool["autoscaling"]["chunksPerReplica"])
        assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
        # KEDA's cooldownPeriod governs only 1 -> 0; N -> M is the HPA's, set explicitly
        # to what values.yaml promises (issue 19 item 7)
        behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == \
            values["autoscaling"]["keda"]["cooldownPeriod"]
        assert behavior["scaleDown"]["policies"] == [
            {"type": "Pods", "value": 1, "periodSeconds": 60}]
    h200 = named(scaled, "ScaledObject", f"{FULLNAME}-worker-h200")
    assert h200["spec"]["minReplicaCount"] == 0  # a GPU pool scales to zero
    # The KEDA operator may reach Redis (and only Redis) to read the queues.
    keda_peer = {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": values["autoscaling"]["keda"]["namespace"]}}}
    for service in ("redis", "minio", "postgresql"):
        (rule,) = named(docs, "NetworkPolicy", f"{FULLNAME}-{service}")["spec"]["ingress"]
        assert (keda_peer in rule["from"]) == (service == "redis"), service


def test_hpa_where_keda_is_absent(helm_bin: str, tmp_path: Path) -> None:
    """Without the KEDA API (mode auto) the same pools get HPAs on the external metric
    farm_queue_depth; a pool that must scale to zero is refused, with the reason."""
    values = yaml.safe_load((ROOT / "helm/examples/autoscaling-keda.yaml").read_text())
    values["autoscaling"]["mode"] = "auto"
    result = template(values, tmp_path, apis=[])
    assert result.returncode != 0 and "minReplicas is 0" in result.stderr
    assert "KEDA" in result.stderr
    values["workers"]["pools"][1]["autoscaling"]["minReplicas"] = 1
    result = template(values, tmp_path, apis=[])
    assert result.returncode == 0, result.stderr
    docs = parse(result.stdout)
    assert not of_kind(docs, "ScaledObject") and not of_kind(docs, "TriggerAuthentication")
    hpas = of_kind(docs, "HorizontalPodAutoscaler")
    assert len(hpas) == 2
    for pool in values["workers"]["pools"]:
        hpa = named(hpas, "HorizontalPodAutoscaler", f"{FULLNAME}-worker-{pool['name']}")
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(hpa, version, strict=True)
        assert hpa["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-worker-{pool['name']}"
        (metric,) = hpa["spec"]["metrics"]
        assert metric["external"]["metric"] == {
            "name": "farm_queue_depth",
            "selector": {"matchLabels": {"fingerprint": pool["fingerprint"]}}}
        assert metric["external"]["target"]["averageValue"] == \
            str(pool["autoscaling"]["chunksPerReplica"])
        # the same scale-down behaviour as in KEDA mode
        assert hpa["spec"]["behavior"]["scaleDown"] == {
            "stabilizationWindowSeconds": values["autoscaling"]["keda"]["cooldownPeriod"],
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}


def _egress_targets(policy: dict, docs: list[dict]) -> set[str]:
    """Components a policy's egress reaches (by pod selector), 'dns', or 'any:<port>'."""
    reach: set[str] = set()
    for rule in policy["spec"]["egress"]:
        ports = {p["port"] for p in rule["ports"]}
        if ports == {53}:
            reach.add("dns")
            continue
        if "to" not in rule:
            reach |= {f"any:{p}" for p in ports}
            continue
        for peer in rule["to"]:
            if "podSelector" in peer:
                hit = {pod_labels(d)["app.kubernetes.io/component"]
                       for d in docs if d["kind"] in ("StatefulSet", "Deployment")
                       and _selects(peer["podSelector"], pod_labels(d))}
                assert hit, f"{policy['metadata']['name']}: a selector that selects nothing"
                reach |= hit
            else:
                reach.add(f"{next(iter(peer))}:{sorted(ports)[0]}")
    return reach


@pytest.mark.parametrize("scenario", ["default", "external"])
def test_network_policies_allow_only_what_each_pod_uses(
        scenario: str, rendered: dict[str, list[dict]]) -> None:
    docs = rendered[scenario]
    policies = of_kind(docs, "NetworkPolicy")
    worker_np = named(policies, "NetworkPolicy", f"{FULLNAME}-worker")
    ingester_np = named(policies, "NetworkPolicy", f"{FULLNAME}-ingester")
    # Which pods each policy governs: every worker pool and the test pod; the ingester.
    test_pod = next(d for d in of_kind(docs, "Pod"))
    for dep in workers(docs):
        assert _selects(worker_np["spec"]["podSelector"], pod_labels(dep))
        assert not _selects(ingester_np["spec"]["podSelector"], pod_labels(dep))
    assert _selects(worker_np["spec"]["podSelector"], pod_labels(test_pod))
    ingester = named(docs, "Deployment", f"{FULLNAME}-ingester")
    assert _selects(ingester_np["spec"]["podSelector"], pod_labels(ingester))
    assert not _selects(worker_np["spec"]["podSelector"], pod_labels(ingester))
    for policy in (worker_np, ingester_np):
        assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        (ingress,) = policy["spec"]["ingress"]
        assert [p["port"] for p in ingress["ports"]] == [9808]  # metrics only
    if scenario == "default":
        assert _egress_targets(worker_np, docs) == {"dns", "redis", "minio"}
        assert _egress_targets(ingester_np, docs) == {"dns", "redis", "postgresql"}
        pg = named(policies, "NetworkPolicy", f"{FULLNAME}-postgresql")
        (rule,) = pg["spec"]["ingress"]
        allowed = {d["metadata"]["name"] for d in of_kind(docs, "Deployment")
                   if any(_selects(peer["podSelector"], pod_labels(d)) for peer in rule["from"])}
        assert allowed == {f"{FULLNAME}-ingester"}
        minio = named(policies, "NetworkPolicy", f"{FULLNAME}-minio")
        (rule,) = minio["spec"]["ingress"]
        allowed = {d["metadata"]["name"] for d in of_kind(docs, "Deployment")
                   if any(_selects(peer["podSelector"], pod_labels(d)) for peer in rule["from"])}
        assert allowed == {d["metadata"]["name"] for d in workers(docs)}
    else:  # external services: any destination, on their ports only
        assert _egress_targets(worker_np, docs) == {"dns", "any:6379", "any:443"}
        assert _egress_targets(ingester_np, docs) == {"dns", "any:6379", "any:5432"}


def test_network_policies_to_external_services_name_them(
        rendered: dict[str, list[dict]]) -> None:
    docs = rendered["example-external-services"]
    worker_np = named(docs, "NetworkPolicy", f"{FULLNAME}-worker")
    assert _egress_targets(worker_np, docs) == {"dns", "ipBlock:6380", "ipBlock:443"}
    cidrs = {peer["ipBlock"]["cidr"] for rule in worker_np["spec"]["egress"]
             for peer in rule.get("to", [])}
    assert cidrs == {"10.20.0.0/24", "10.30.0.0/24"}


def test_service_monitor_scrapes_workers_and_ingester(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["example-autoscaling-keda"]
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    services = [s for s in of_kind(docs, "Service")
                if _selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
    components = set()
    for service in services:
        (port,) = service["spec"]["ports"]
        assert port["name"] == monitor["spec"]["endpoints"][0]["port"] == "metrics"
        backing = [d for d in of_kind(docs, "Deployment")
                   if _selects({"matchLabels": service["spec"]["selector"]}, pod_labels(d))]
        assert backing
        for dep in backing:
            (container,) = dep["spec"]["template"]["spec"]["containers"]
            assert {"name": "metrics", "containerPort": 9808} in container["ports"]
            components.add(pod_labels(dep)["app.kubernetes.io/component"])
    assert components == {"worker", "ingester"}


def exported_metrics() -> set[str]:
    """Metric names farm/cluster/metrics.py exports (without _total/_bucket/... suffixes)."""
    source = (ROOT / "farm" / "cluster" / "metrics.py").read_text()
    counters = source.split("COUNTERS = (")[1].split(")")[0]
    return set(re.findall(r'"(farm_[a-z_]+)', source)) | \
        {f"farm_ingest_{c}" for c in re.findall(r'"([a-z]+)"', counters)}


def metric_names(expr: str) -> set[str]:
    return {re.sub(r"_(bucket|total|sum|count)$", "", n)
            for n in re.findall(r"\b(farm_[a-z_]+)", expr)}


def test_grafana_dashboard_uses_the_exported_metrics(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["example-autoscaling-keda"]
    board = named(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(board["data"]["kernel-farm.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    names = set().union(*(metric_names(e) for e in exprs))
    assert names <= exported_metrics(), names - exported_metrics()
    assert {"farm_queue_depth", "farm_kernels", "farm_compile_seconds",
            "farm_ingest_lag_entries"} <= names


def test_alerts_use_the_exported_metrics_and_are_documented(
        rendered: dict[str, list[dict]]) -> None:
    (rule,) = of_kind(rendered["example-autoscaling-keda"], "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    assert len(rules) >= 8
    operations = (ROOT / "docs" / "OPERATIONS.md").read_text()
    for alert in rules:
        names = metric_names(alert["expr"])
        assert names and names <= exported_metrics(), alert["alert"]
        assert f'namespace="{NAMESPACE}"' in alert["expr"]
        assert f"`{alert['alert']}`" in operations, f"{alert['alert']} is not in OPERATIONS.md"
    assert not of_kind(rendered["default"], "PrometheusRule")  # off unless asked for


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_images_are_pinned(scenario: str, rendered: dict[str, list[dict]]) -> None:
    for where, container in containers(rendered[scenario]):
        image = container["image"]
        name, _, tag = image.split("@")[0].rpartition(":")
        assert name and tag and tag != "latest", f"{where}: {image} floats"
        if any(x in name for x in ("redis", "postgres")):
            assert re.fullmatch(r"\d+\.\d+(\.\d+)?", tag) and tag.count(".") >= 1, image
    values = chart_values(scenario)
    digest = values["images"]["workerCpu"].get("digest")
    if digest:
        cpu = [c["image"] for _, c in containers(rendered[scenario])
               if "worker-cpu" in c["image"]]
        assert cpu and all(image.endswith(f"@{digest}") for image in cpu)


def test_helm_test_builds_against_the_release(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["example-autoscaling-keda"]
    (pod,) = of_kind(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    assert container["command"][-1] == "farm"
    args = container["args"]
    assert args[:3] == ["build", "tiny", "--cluster"]
    pool = next(p for p in chart_values("example-autoscaling-keda")["workers"]["pools"]
                if p["name"] == "cpu-pocl")
    assert flag(args, "--fingerprint") == pool["fingerprint"]
    assert "--wait-for-workers" in args
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container["env"]}
    # a build client needs read-only MinIO credentials (issue 19 item 5)
    assert refs == {"FARM_REDIS_URL": "redis-url",
                    "FARM_MINIO_ACCESS_KEY": "minio-reader-access-key",
                    "FARM_MINIO_SECRET_KEY": "minio-reader-secret-key"}
    assert pod["spec"]["restartPolicy"] == "Never"


def _cuda_cache(docs: list[dict], values: dict[str, Any]) -> dict[str, dict]:
    """Each pool's ``cuda-cache`` volume (or ``{}``), after checking that nvidia pools
    point CUDA_CACHE_PATH at it and other pools have none."""
    found = {}
    for pool in values["workers"]["pools"]:
        dep = named(docs, "Deployment", f"{FULLNAME}-worker-{pool['name']}")
        spec = dep["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "initContainers" not in spec  # nothing to hand over as root
        if pool.get("type") == "nvidia":
            mount = next(m for m in container["volumeMounts"] if m["name"] == "cuda-cache")
            assert env["CUDA_CACHE_PATH"] == mount["mountPath"]
            found[pool["name"]] = volumes["cuda-cache"]
        else:
            assert "CUDA_CACHE_PATH" not in env and "cuda-cache" not in volumes
            found[pool["name"]] = {}
    return found


def test_nvidia_pools_keep_the_cuda_cache_in_the_pod(rendered: dict[str, list[dict]]) -> None:
    """By default an emptyDir, which the worker's uid writes through the pod's fsGroup:
    no root step to own it (issue 33 item 6)."""
    found = _cuda_cache(rendered[EXAMPLE_SCENARIO], chart_values(EXAMPLE_SCENARIO))
    assert found["h200"] == {"name": "cuda-cache", "emptyDir": {}}
    assert found["cpu-pocl"] == {}


def test_a_node_folder_for_the_cuda_cache_is_used_never_made(helm_bin: str,
                                                            tmp_path: Path) -> None:
    """With cudaCache.hostPath the folder must exist (type Directory: a pod waits for it
    rather than writing into one the kubelet made for root), and no container chowns
    it."""
    values = yaml.safe_load(EXAMPLE.read_text())
    values["cudaCache"] = {"hostPath": "/var/cache/kernel-farm/cuda"}
    result = template(values, tmp_path)
    assert result.returncode == 0, result.stderr
    docs = parse(result.stdout)
    found = _cuda_cache(docs, chart_values(EXAMPLE_SCENARIO))
    assert found["h200"]["hostPath"] == {"path": "/var/cache/kernel-farm/cuda",
                                         "type": "Directory"}
    _assert_no_root(docs, "cudaCache.hostPath")


def _assert_no_root(docs: list[dict], scenario: str) -> None:
    """Every container's effective security context (its own over its pod's) says
    non-root with a non-zero uid."""
    checked = 0
    for name, spec in pod_specs(docs, every=True):
        pod = spec.get("securityContext") or {}
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            effective = {**pod, **(c.get("securityContext") or {})}
            where = f"{scenario}: {name}/{c['name']}"
            assert effective.get("runAsNonRoot") is True, where
            assert isinstance(effective.get("runAsUser"), int), where
            assert effective["runAsUser"] != 0, where
            assert "add" not in (effective.get("capabilities") or {}), where
            checked += 1
    assert checked, f"{scenario}: no container rendered"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_no_container_runs_as_root(scenario: str, rendered: dict[str, list[dict]]) -> None:
    """Every container of every scenario and example, init containers, Jobs and the
    helm test Pod included (issue 33 item 6: an init container ran as uid 0)."""
    _assert_no_root(rendered[scenario], scenario)


def test_celery_args_pass_through(rendered: dict[str, list[dict]]) -> None:
    dep = named(rendered["example-autoscaling-keda"], "Deployment",
                f"{FULLNAME}-worker-cpu-pocl")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--") + 1:] == ["--max-tasks-per-child=500"]


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
        assert any(a.startswith("PYTHON_IMAGE=python:3.11") for a in instructions["ARG"])
        run = " ".join(instructions["RUN"])
        assert "requirements.lock" in run and "--require-hashes" in run
        # PoCL links each kernel with the system `ld` against -lgcc -lgcc_s -lc.
        assert "gcc" in run.split() and "libc6-dev" in run.split()


# -- least privilege, signing, a private CA (issue 19 items 5, 6) ----------------------------


def env_refs(container: dict) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"],
                        e["valueFrom"]["secretKeyRef"]["key"])
            for e in container.get("env", []) if "valueFrom" in e}


@pytest.mark.parametrize("scenario", ["default", EXAMPLE_SCENARIO])
def test_each_pool_gets_minio_credentials_for_its_own_namespace(
        scenario: str, rendered: dict[str, list[dict]]) -> None:
    """Issue 19 item 5: every pod had the MinIO root user. Now each pool's workers get
    their pool's user, the test pod a reader; only MinIO and its set-up Job see root."""
    docs = rendered[scenario]
    values = chart_values(scenario)
    for pool in values["workers"]["pools"]:
        dep = named(docs, "Deployment", f"{FULLNAME}-worker-{pool['name']}")
        refs = env_refs(dep["spec"]["template"]["spec"]["containers"][0])
        assert refs["FARM_MINIO_ACCESS_KEY"][1] == f"minio-pool-{pool['name']}-access-key"
        assert refs["FARM_MINIO_SECRET_KEY"][1] == f"minio-pool-{pool['name']}-secret-key"
    root_keys = {"minio-access-key", "minio-secret-key"}
    root_users = {where for where, c in containers(docs, every=True)
                  if root_keys & {k for _, k in env_refs(c).values()}}
    assert root_users == {f"{FULLNAME}-minio/minio", f"{FULLNAME}-minio-access/access"}
    # the repair role (deletes every version) is no pod's: only the set-up Job reads it
    repair_keys = {"minio-repair-access-key", "minio-repair-secret-key"}
    repair_users = {where for where, c in containers(docs, every=True)
                    if repair_keys & {k for _, k in env_refs(c).values()}}
    assert repair_users == {f"{FULLNAME}-minio-access/access"}


def test_the_bundled_minio_set_up_job_makes_what_the_pods_use(
        rendered: dict[str, list[dict]]) -> None:
    """The post-install Job runs farm.cluster.access with grants naming each pool's
    fingerprint, a reader and the repair role; read back through the same code, with the
    Secret's values, they are the credentials the pods get (issue 33: the chart made no
    repair user). An existingSecret without the repair keys: that user is left out, in
    one line, and the rest is made."""
    from farm.cluster.access import REPAIR_POLICY, grants_from_env, pool_policy_name

    docs = rendered[EXAMPLE_SCENARIO]
    values = chart_values(EXAMPLE_SCENARIO)
    job = named(docs, "Job", f"{FULLNAME}-minio-access")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][-3:] == ["python", "-m", "farm.cluster.access"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    for name, (_, key) in env_refs(container).items():
        env[name] = f"{key}-value-0123456789"
    grants, skipped = grants_from_env(env)
    assert skipped == []
    pools = values["workers"]["pools"]
    assert sorted((g.fingerprint or "", g.reader, g.repair) for g in grants) == sorted(
        [(p["fingerprint"], False, False) for p in pools] + [("", True, False),
                                                             ("", False, True)])
    (repair,) = (g for g in grants if g.repair)
    assert repair.policy == REPAIR_POLICY
    assert repair.access_key == "minio-repair-access-key-value-0123456789"
    optional = {e["name"] for e in container["env"]
                if e.get("valueFrom", {}).get("secretKeyRef", {}).get("optional")}
    assert optional == {"ACCESS_REPAIR_KEY_ID", "ACCESS_REPAIR_SECRET"}
    without = {k: v for k, v in env.items() if k not in optional}
    grants, skipped = grants_from_env(without)
    assert not any(g.repair for g in grants) and len(grants) == len(pools) + 1
    assert skipped == ["repair user not made: ACCESS_REPAIR_KEY_ID and "
                       "ACCESS_REPAIR_SECRET are empty"]
    # a pool's keys missing is no option: it fails as before
    broken = {**env, "ACCESS_0_KEY_ID": ""}
    with pytest.raises(pydantic.ValidationError):
        grants_from_env(broken)
    for pool in pools:
        grant = next(g for g in grants if g.fingerprint == pool["fingerprint"])
        assert grant.access_key == f"minio-pool-{pool['name']}-access-key-value-0123456789"
        assert pool_policy_name(grant.fingerprint).endswith(pool["fingerprint"])
    policy = named(docs, "NetworkPolicy", f"{FULLNAME}-minio")
    (rule,) = policy["spec"]["ingress"]
    assert any(_selects(peer["podSelector"], pod_labels(job)) for peer in rule["from"]
               if "podSelector" in peer)


def test_pool_credentials_are_derived_stably_and_differ(
        rendered: dict[str, list[dict]]) -> None:
    data = secret_values(rendered["default"])
    assert data["minio-pool-cpu-access-key"] == "farm-pool-cpu"
    assert data["minio-reader-access-key"] == "farm-reader"
    assert data["minio-repair-access-key"] == "farm-repair"
    secrets_made = {data["minio-pool-cpu-secret-key"], data["minio-reader-secret-key"],
                    data["minio-repair-secret-key"], data["minio-secret-key"]}
    assert len(secrets_made) == 4
    assert len(data["minio-pool-cpu-secret-key"]) == len(data["minio-reader-secret-key"]) == 40


def test_signing_keys_and_a_ca_bundle_come_from_secrets(
        rendered: dict[str, list[dict]]) -> None:
    """Issue 19 item 6: no place for FARM_SIGNING_KEY / FARM_VERIFY_KEY or a CA bundle
    (read-only root, closed schema). Writers get the signing key, every farm pod the
    verify key and the CA bundle, all from Secrets."""
    docs = rendered["signed-private-ca"]
    for where, container in containers(docs, every=True):
        component = where.split("/")[0]
        if component.endswith(("-redis", "-minio", "-postgresql")):
            continue
        refs = env_refs(container)
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        is_worker = "-worker-" in component
        if is_worker or component.endswith("-test-build"):
            assert refs["FARM_VERIFY_KEY"] == (SIGNING_SECRET, "verify-key"), where
        assert ("FARM_SIGNING_KEY" in refs) == is_worker, where
        if is_worker:
            assert refs["FARM_SIGNING_KEY"] == (SIGNING_SECRET, "signing-key")
        mount = next(m for m in container["volumeMounts"] if m["name"] == "ca-bundle")
        assert mount["readOnly"] is True
        assert env["SSL_CERT_FILE"] == f"{mount['mountPath']}/ca.crt"
        assert env["PGSSLROOTCERT"] == env["SSL_CERT_FILE"]
    for name, spec in pod_specs(docs, every=True):
        if name.endswith(("-redis", "-minio", "-postgresql")):
            continue
        (volume,) = [v for v in spec["volumes"] if v["name"] == "ca-bundle"]
        assert volume["secret"]["secretName"] == CA_SECRET, name
    unsigned = rendered["default"]
    assert not any("FARM_SIGNING_KEY" in env_refs(c) or "FARM_VERIFY_KEY" in env_refs(c)
                   for _, c in containers(unsigned, every=True))
