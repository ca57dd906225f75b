"""Config: lookup order, defaults shipped in etc/, unknown keys and wrong types named."""

from pathlib import Path

import pytest

from gpuprof.collector import config
from gpuprof.collector.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_shipped_file_equals_builtin_defaults() -> None:
    assert (REPO / "etc" / "gpuprof.toml").read_text().strip() == config.render_defaults().strip()
    assert config.load(str(REPO / "etc" / "gpuprof.toml")) == config.defaults()


def test_override_and_nested_section(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[sources.nvml]\nrate_hz = 2\ngpus = "all"\n[dcgm]\ndcgmi = "/x/dcgmi"\n')
    cfg = config.load(str(f))
    assert cfg["sources.nvml"]["rate_hz"] == 2
    assert cfg["sources.nvml"]["gpus"] == "all"
    assert cfg["dcgm"]["dcgmi"] == "/x/dcgmi"
    assert cfg["sources.host"]["rate_hz"] == 10.0  # untouched default


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[dcgm]\nbogus = 1\n", "dcgm.bogus"),
        ("[nosuch]\nx = 1\n", "nosuch"),
        ("[sources.nvml]\nrate_hz = \"fast\"\n", "sources.nvml.rate_hz"),
        ("[dcgm]\ntimeout_s = true\n", "dcgm.timeout_s"),
        ("[sources]\nnvml = 3\n", "sources.nvml"),
        ("[sources.bogus]\nx = 1\n", "sources.bogus"),
    ],
)
def test_bad_keys_are_named(tmp_path: Path, text: str, named: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")) as e:
        config.load(str(f))
    assert str(f) in str(e.value)


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[dcgm\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(str(f))
    with pytest.raises(ConfigError, match="not found"):
        config.load(str(tmp_path / "absent.toml"))


def test_env_variable_is_used_and_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[collector]\nmemory_limit_mb = 32\n")
    monkeypatch.setenv("GPUPROF_CONFIG", str(f))
    assert config.load()["collector"]["memory_limit_mb"] == 32
    monkeypatch.setenv("GPUPROF_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(ConfigError, match="gone.toml"):
        config.load()
