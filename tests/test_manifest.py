"""Manifests: the built-in ones, model expansion, and one-line errors for bad files.

Every malformed file must give one ``ManifestError`` line naming the file and, where
there is one, the line and the field: that line is all a person sees from the CLI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from farm.cli.manifest import app
from farm.core.errors import ManifestError
from farm.families.registry import Registry
from farm.manifest import (
    MAX_FILE_BYTES,
    MAX_KERNELS,
    Entry,
    Manifest,
    builtin_manifests,
    expand,
    load_manifest,
    resolve_manifest,
    summarize,
)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.load()


def _write(tmp_path: Path, text: str | bytes, name: str = "m.toml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _error_of(path: Path, registry: Registry) -> str:
    """The one-line message of loading and expanding ``path``."""
    with pytest.raises(ManifestError) as info:
        expand(load_manifest(path), registry)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith(str(path)), message
    return message


_SMALL_MODEL = """\
format = 1

[model]
name = "toy"
hidden = 64
heads = 4
kv_heads = 2
head_dim = 16
intermediate = 96
vocab = 200
dtypes = ["float", "half"]
tokens = [1, 8]

[model.tuning]
"*" = [
    { tile_m = 16, tile_n = 16, tile_k = 16 },
    { tile_m = 32, tile_n = 32, tile_k = 8, wpt_m = 2, wpt_n = 2 },
]
lm_head = [{ tile_m = 8, tile_n = 64, tile_k = 8, wpt_n = 4 }]
"""


# -- the built-in manifests ----------------------------------------------------------------
@pytest.mark.parametrize(("name", "low", "high"), [
    ("tiny", 15, 25), ("medium", 150, 260), ("large", 1500, 5000)])
def test_builtin_counts(name: str, low: int, high: int, registry: Registry) -> None:
    entries = expand(load_manifest(resolve_manifest(name)), registry)
    assert low <= len(entries) <= high
    assert sum(summarize(entries).values()) == len(entries)


def test_every_builtin_loads_and_expands(registry: Registry) -> None:
    builtins = builtin_manifests()
    assert {"tiny", "medium", "large"} <= set(builtins)
    for path in builtins.values():
        entries = expand(load_manifest(path), registry)
        assert entries
        assert all(e.family in registry for e in entries)


def test_tiny_is_small_float_and_varied(registry: Registry) -> None:
    entries = expand(load_manifest(resolve_manifest("tiny")), registry)
    assert len(summarize(entries)) >= 6
    assert {e.artifact.kernel.params["dtype"] for e in entries} == {"float"}
    for e in entries:  # small enough to compile in about a second each on two cores
        if e.family == "matmul":
            p = e.artifact.kernel.params
            assert p["m"] * p["n"] * p["k"] <= 64**3


def test_medium_is_a_float_model_with_tuning(registry: Registry) -> None:
    manifest = load_manifest(resolve_manifest("medium"))
    assert manifest.model is not None and manifest.kernels
    entries = expand(manifest, registry)
    assert {e.artifact.kernel.params["dtype"] for e in entries} == {"float"}
    matmul_tiles = {(e.artifact.kernel.params["tile_m"], e.artifact.kernel.params["tile_n"])
                    for e in entries if e.family == "matmul"}
    assert len(matmul_tiles) >= 3


def test_large_is_an_8b_llama(registry: Registry) -> None:
    manifest = load_manifest(resolve_manifest("large"))
    model = manifest.model
    assert model is not None
    assert (model.hidden, model.heads, model.kv_heads, model.head_dim, model.intermediate,
            model.vocab) == (4096, 32, 8, 128, 14336, 128256)
    assert set(model.dtypes) == {"float", "half"}
    assert len(model.tokens) >= 4
    entries = expand(manifest, registry)
    params = [e.artifact.kernel.params for e in entries if e.family == "matmul"]
    assert {p["dtype"] for p in params} == {"float", "half"}
    assert {(p["n"], p["k"]) for p in params} >= {
        (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (64128, 4096)}
    # a real tuning space: some candidates exceed common work-group and local memory limits
    assert any(p["tile_m"] // p["wpt_m"] * p["tile_n"] // p["wpt_n"] > 1024 for p in params)
    assert any((p["tile_m"] + p["tile_n"]) * p["tile_k"] * 4 > 64 * 1024 for p in params)


# -- expansion ------------------------------------------------------------------------------
def test_model_expansion(tmp_path: Path, registry: Registry) -> None:
    entries = expand(load_manifest(_write(tmp_path, _SMALL_MODEL)), registry)
    by_origin = {e.origin: e.artifact.kernel for e in entries}
    qkv = by_origin["model float qkv tokens=8 cand=1"]
    assert qkv.params.items() >= {"m": 8, "n": (4 + 2 * 2) * 16, "k": 64, "tile_m": 32,
                                  "wpt_m": 2, "dtype": "float"}.items()
    assert by_origin["model half gate_up tokens=1 cand=0"].params["n"] == 2 * 96
    assert by_origin["model float down tokens=1 cand=0"].params["k"] == 96
    # a named shape replaces the "*" candidates
    lm = [k for o, k in by_origin.items() if " lm_head " in o]
    assert {k.params["tile_n"] for k in lm} == {64} and len(lm) == 2 * 2
    assert by_origin["model float rotary heads=4"].params["heads"] == 4
    assert by_origin["model float rotary kv_heads=2"].params["heads"] == 2
    assert by_origin["model half attention softmax tokens=8"].params["cols"] == 8
    assert by_origin["model float vocab softmax"].params["cols"] == 200
    assert by_origin["model float swiglu"].params["hidden"] == 96
    assert by_origin["model float residual add"].params["op"] == "add"
    for family in ("rmsnorm", "attention", "swiglu", "elementwise_binary"):
        # token-independent kernels: one per element type, not one per bucket
        assert summarize(entries)[family] == 2


def test_wide_lm_head_is_split_to_the_matmul_limit(tmp_path: Path, registry: Registry) -> None:
    text = _SMALL_MODEL.replace("vocab = 200", "vocab = 100001").replace(
        'dtypes = ["float", "half"]', 'dtypes = ["float"]')
    entries = expand(load_manifest(_write(tmp_path, text)), registry)
    lm = [e.artifact.kernel.params["n"] for e in entries if " lm_head " in e.origin]
    assert lm == [50001, 50000, 50001, 50000]


def test_expansion_is_deterministic(registry: Registry) -> None:
    path = resolve_manifest("large")
    first = [e.id_hash for e in expand(load_manifest(path), registry)]
    second = [e.id_hash for e in expand(load_manifest(path), registry)]
    assert first == second
    assert len(set(first)) == len(first)


def test_duplicates_keep_their_first_origin(tmp_path: Path, registry: Registry) -> None:
    text = _SMALL_MODEL + """
[[kernels]]
family = "softmax"
params = { cols = 8, dtype = "float" }    # the model's softmax for 8 tokens

[[kernels]]
family = "elementwise_unary"
params = { op = "relu" }

[[kernels]]
family = "elementwise_unary"
params = { op = "relu", width = 1, dtype = "float" }   # defaults spelled out

[[kernels]]
family = "elementwise_unary"
params = { op = "relu" }
options = ["-cl-fast-relaxed-math"]                  # another variant: kept
"""
    entries = expand(load_manifest(_write(tmp_path, text)), registry)
    model_only = expand(load_manifest(_write(tmp_path, _SMALL_MODEL, "model.toml")), registry)
    assert [e.origin for e in entries[len(model_only):]] == ["kernels[1]", "kernels[3]"]
    assert entries[len(model_only) + 1].artifact.variant.options == ("-cl-fast-relaxed-math",)
    assert len({e.id_hash for e in entries}) == len(entries)


def test_explicit_kernel_launch_and_variant(tmp_path: Path, registry: Registry) -> None:
    text = """format = 1
[[kernels]]
family = "elementwise_binary"
params = { op = "add" }
local_size = [64]
options = ["-cl-mad-enable"]
"""
    (entry,) = expand(load_manifest(_write(tmp_path, text)), registry)
    assert isinstance(entry, Entry)
    assert entry.artifact.kernel.launch.local_size == (64,)
    assert entry.artifact.variant.options == ("-cl-mad-enable",)
    assert entry.origin == "kernels[0]"


def test_summarize_counts_per_family(registry: Registry) -> None:
    entries = expand(load_manifest(resolve_manifest("tiny")), registry)
    counts = summarize(entries)
    assert list(counts) == sorted(counts)
    assert counts["matmul"] == sum(1 for e in entries if e.family == "matmul")


# -- resolving names ------------------------------------------------------------------------
def test_resolve_manifest(tmp_path: Path) -> None:
    assert resolve_manifest("tiny") == builtin_manifests()["tiny"]
    assert resolve_manifest("medium.toml") == builtin_manifests()["medium"]
    own = _write(tmp_path, "format = 1\n", "tiny")
    assert resolve_manifest(str(own)) == own
    with pytest.raises(ManifestError) as info:
        resolve_manifest("no-such-manifest")
    message = str(info.value)
    assert "no-such-manifest" in message and "large, medium, tiny" in message


# -- malformed files: one line, file, line and field -----------------------------------
_KERNEL = '[[kernels]]\nfamily = "softmax"\nparams = { cols = 64 }\n\n'

_MALFORMED: dict[str, tuple[str | bytes, int | None, str]] = {
    # name: (text, line, what the message must also say)
    "syntax error": ("format = 1\n[[kernels]\nfamily = 1\n", 2, "TOML syntax error"),
    "unknown family": ("format = 1\n\n" + _KERNEL + '[[kernels]]\nfamily = "convolution"\n',
                       8, "kernels[1].family: unknown kernel family 'convolution'"),
    "out-of-range param": ("format = 1\n" + _KERNEL + _KERNEL.replace("64", "0"), 8,
                           "kernels[1].params.cols: softmax: parameter cols: Input should "
                           "be greater than or equal to 1"),
    "bad literal param": ("format = 1\n" + _KERNEL + '[[kernels]]\nfamily = '
                          '"elementwise_binary"\nparams = { op = "pow" }\n', 8,
                          "kernels[1].params.op: elementwise_binary: parameter op: Input "
                          "should be 'add', 'sub'"),
    "missing param": ('format = 1\n[[kernels]]\nfamily = "matmul"\nparams = { m = 4, k = 4 }\n',
                      4, "kernels[0].params.n: matmul: parameter n: Field required"),
    "wrong type": ("format = 1\n" + _KERNEL + _KERNEL.replace("}\n", "}\nlocal_size = 64\n"), 9,
                   "kernels[1].local_size: Input should be a valid list"),
    "wrong type in model": (_SMALL_MODEL.replace("hidden = 64", 'hidden = "64"'), 5,
                            "model.hidden: Input should be a valid integer"),
    "missing required field": ("format = 1\n" + _KERNEL + "[[kernels]]\nparams = {}\n", 6,
                               "kernels[1].family: Field required"),
    "missing model field": (_SMALL_MODEL.replace("vocab = 200\n", ""), 3,
                            "model.vocab: Field required"),
    "unknown key": ("format = 1\n" + _KERNEL + _KERNEL.replace("}\n", '}\ncolour = "red"\n'),
                    9, "kernels[1].colour: unknown key (allowed: family, params"),
    "unknown matrix shape": (_SMALL_MODEL.replace("lm_head = ", "lm_haed = "), 19,
                             "model.tuning.lm_haed: Input should be 'qkv'"),
    "bad tuning candidate": (_SMALL_MODEL.replace("wpt_m = 2, wpt_n = 2", "wpt_m = 2, wpt_n = 3"),
                             17, 'model.tuning."*"[1].wpt_n: matmul: parameter wpt_n: Input '
                             "should be 1, 2, 4 or 8 (model float qkv tokens=1 cand=1)"),
    "bad token bucket": (_SMALL_MODEL.replace("tokens = [1, 8]", "tokens = [1, 0]"), 12,
                         "model.tokens[1]: Input should be greater than or equal to 1"),
    "heads not grouped": (_SMALL_MODEL.replace("kv_heads = 2", "kv_heads = 3"), 3,
                          "model: heads (4) must be a multiple of kv_heads (3)"),
    "bad build option": ("format = 1\n" + _KERNEL.replace("}\n", '}\noptions = ["fast"]\n'), 5,
                         "kernels[0].options: build option 'fast' must be a single '-' flag"),
    "bad local size": ("format = 1\n" + _KERNEL.replace("}\n", "}\nlocal_size = [0]\n"), 5,
                       "kernels[0].local_size: local_size must be 1 to 3 integers from 1 to 65536"),
    "other format": ("format = 2\n" + _KERNEL, 1, "format: format 2 is not supported"),
    "truncated file": ('format = 1\n[[kernels]]\nfamily = "softmax"\nparams = { cols = 6', 4,
                       "TOML syntax error: Unclosed inline table (at end of file: truncated?)"),
    "truncated after a key": ('format = 1\n[[kernels]]\nfamily = "soft', 3, "TOML syntax error"),
    "not utf-8": (b'format = 1\nname = "caf\xe9"\n', 2, "not UTF-8 text (byte 0xe9"),
    "binary garbage": (b"format = 1\n\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", 4,
                       "binary data (a NUL byte), not a TOML text file"),
    "empty file": ("", None, "empty file"),
    "only comments": ("# nothing here\n\n", None, "no keys"),
    "no kernels": ("format = 1\nname = 'x'\n", None, "the manifest asks for no kernels"),
    "no format": (_KERNEL, None, "format: Field required"),
}


@pytest.mark.parametrize("case", list(_MALFORMED))
def test_malformed_manifest(case: str, tmp_path: Path, registry: Registry) -> None:
    text, line, what = _MALFORMED[case]
    path = _write(tmp_path, text)
    message = _error_of(path, registry)
    where = f"{path}:{line}: " if line is not None else f"{path}: "
    assert message.startswith(where), message
    assert what in message, message


def test_directory_instead_of_file(tmp_path: Path, registry: Registry) -> None:
    assert "is a directory" in _error_of(tmp_path, registry)


def test_nonexistent_path(tmp_path: Path, registry: Registry) -> None:
    assert "no such file" in _error_of(tmp_path / "missing.toml", registry)


def test_unreadable_path(tmp_path: Path, registry: Registry) -> None:
    plain = _write(tmp_path, "format = 1\n" + _KERNEL)
    assert "cannot read: Not a directory" in _error_of(plain / "child.toml", registry)
    assert "not a regular file" in _error_of(Path("/dev/null"), registry)


def test_absurdly_large_file(tmp_path: Path, registry: Registry) -> None:
    path = tmp_path / "big.toml"
    with path.open("wb") as fh:  # sparse: refused by its size before it is read
        fh.truncate(MAX_FILE_BYTES + 1)
    message = _error_of(path, registry)
    assert f"at most {MAX_FILE_BYTES} bytes" in message


def test_random_garbage_never_tracebacks(tmp_path: Path, registry: Registry) -> None:
    import random

    rng = random.Random(1234)
    for i in range(50):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        _error_of(_write(tmp_path, data, f"g{i}.toml"), registry)


def test_huge_expansion_is_refused(tmp_path: Path, registry: Registry) -> None:
    candidates = ", ".join("{ tile_m = 16 }" for _ in range(1000))
    text = _SMALL_MODEL.replace("tokens = [1, 8]", f"tokens = {list(range(1, 65))}").replace(
        'dtypes = ["float", "half"]', 'dtypes = ["float", "half", "double"]') + (
        f'qkv = [{candidates}]\no = [{candidates}]\n')
    message = _error_of(_write(tmp_path, text), registry)
    assert re.search(rf":3: model: expands to more than {MAX_KERNELS} kernels", message)


def test_manifest_rejects_unknown_top_level_key(tmp_path: Path, registry: Registry) -> None:
    message = _error_of(_write(tmp_path, "format = 1\nkernel = []\n" + _KERNEL), registry)
    assert message.startswith(f"{tmp_path / 'm.toml'}:2: kernel: unknown key")


def test_manifest_in_code_has_no_file(registry: Registry) -> None:
    manifest = Manifest.model_validate(
        {"format": 1, "kernels": [{"family": "softmax", "params": {"cols": 0}}]})
    with pytest.raises(ManifestError, match=r"^<manifest>: kernels\[0\]\.params\.cols: "):
        expand(manifest, registry)


# -- the CLI --------------------------------------------------------------------------------
runner = CliRunner()


def test_cli_show_table(registry: Registry) -> None:
    result = runner.invoke(app, ["show", "tiny"])
    assert result.exit_code == 0, result.output
    entries = expand(load_manifest(resolve_manifest("tiny")), registry)
    for family, count in summarize(entries).items():
        assert re.search(rf"{family}\s+\S\s+{count}\b", result.stdout), result.stdout
    assert re.search(rf"total\s+\S\s+{len(entries)}\b", result.stdout)


def test_cli_show_json(registry: Registry) -> None:
    result = runner.invoke(app, ["show", "medium", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    entries = expand(load_manifest(resolve_manifest("medium")), registry)
    assert data["families"] == summarize(entries)
    assert data["total"] == len(entries)
    assert data["manifest"] == str(resolve_manifest("medium"))


def test_cli_show_a_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "format = 1\n" + _KERNEL)
    result = runner.invoke(app, ["show", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["families"] == {"softmax": 1}


@pytest.mark.parametrize(("text", "expect"), [
    ("format = 1\n[[kernels]\n", ":2: TOML syntax error"),
    ("format = 1\n" + _KERNEL.replace("64", "-1"), ":4: kernels[0].params.cols: softmax"),
    ("", ": empty file"),
])
def test_cli_show_malformed_exits_2(text: str, expect: str, tmp_path: Path) -> None:
    path = _write(tmp_path, text)
    result = runner.invoke(app, ["show", str(path)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"{path}{expect}"), result.stderr


def test_cli_show_unknown_name_exits_2() -> None:
    result = runner.invoke(app, ["show", "no-such-manifest"])
    assert result.exit_code == 2
    assert "built-in: large, medium, tiny" in result.stderr
    assert result.stderr.count("\n") == 1


def test_cli_show_directory_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["show", str(tmp_path), "--json"])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"{tmp_path}: is a directory, not a manifest file"


def test_a_misspelt_parameter_is_named_and_every_error_is_reported(
        tmp_path: Path, registry: Registry) -> None:
    """``alpha`` for ``a``: the unknown name is reported (with those allowed), beside
    the missing one; and every kernel's errors come at once, each at its own line."""
    text = ("format = 1\n\n"
            "[[kernels]]\nfamily = \"reduce\"\nparams = { op = \"sum\", colz = 10 }\n\n"
            "[[kernels]]\nfamily = \"softmax\"\nparams = { cols = 64 }\n\n"
            "[[kernels]]\nfamily = \"softmax\"\nparams = { cols = -3 }\n")
    path = _write(tmp_path, text)
    with pytest.raises(ManifestError) as info:
        expand(load_manifest(path), registry)
    assert info.value.lines == [
        f"{path}:5: kernels[0].params.cols: reduce: parameter cols: Field required",
        f"{path}:5: kernels[0].params.colz: reduce: parameter colz: unknown parameter "
        "(allowed: op, cols, group_size, dtype)",
        f"{path}:13: kernels[2].params.cols: softmax: parameter cols: Input should be "
        "greater than or equal to 1",
    ]
    assert str(info.value) == info.value.lines[0] + " (and 2 more errors)"


def test_every_error_of_a_manifest_shape_is_reported_in_file_order(
        tmp_path: Path, registry: Registry) -> None:
    path = _write(tmp_path, 'format = 1\ncolour = "red"\n' + _KERNEL
                  + _KERNEL.replace("}\n", "}\nshape = 3\n"))
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert [line.split(": ", 2)[:2] for line in info.value.lines] == [
        [f"{path}:2", "colour"], [f"{path}:10", "kernels[1].shape"]]


def test_the_cli_prints_one_error_line_per_problem(tmp_path: Path) -> None:
    path = _write(tmp_path, 'format = 1\n[[kernels]]\nfamily = "matmul"\n'
                  'params = { m = 4, k = 4, alpha = 2 }\n')
    farm = Path(sys.executable).with_name("farm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    proc = subprocess.run([str(farm), "build", str(path), "--local"], capture_output=True,
                          text=True, env={**env, "FARM_HOME": str(tmp_path / "h")},
                          check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [line.split(": ", 3)[2] for line in lines] == [
        "kernels[0].params.n", "kernels[0].params.alpha"], proc.stderr
    assert all(line.startswith(f"error: {path}:4: ") for line in lines)
