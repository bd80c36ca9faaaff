"""The wheel: configs/ ships inside it (rlalign/configs/), and the wheel installed in a fresh virtual
environment runs rlalign from another directory on its own packaged configs, not a checkout's.

The fresh environment reuses this one's installed dependencies through a .pth line (torch and the rest
are not installed twice); rlalign itself comes only from the wheel (this environment's editable
install is a finder that a .pth path line does not load)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BUILD_INPUTS = ("pyproject.toml", "README.md", "rlalign", "kernels", "actors", "configs")
TINY_AGREE = ["trainer.ep_size=1", "agree.num_prompts=2", "agree.max_new_tokens=2"]

pytestmark = pytest.mark.slow  # each builds a wheel (~2 s); the install test runs rlalign 5 times


def build_wheel(src: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = out.glob("rlalign-*.whl")
    return wheel


def copy_sources(dest: Path) -> Path:
    """What building the wheel reads, without caches or a previous build."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, dest / name)
    return dest


def configs_left_out(wheel: Path, configs: Path) -> list[str]:
    """The configs/ YAML files that the wheel does not hold as rlalign/configs/..."""
    shipped = set(zipfile.ZipFile(wheel).namelist())
    return [f"configs/{p.relative_to(configs)}" for p in sorted(configs.rglob("*.yaml"))
            if f"rlalign/configs/{p.relative_to(configs)}" not in shipped]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = copy_sources(tmp_path_factory.mktemp("src"))
    return build_wheel(src, tmp_path_factory.mktemp("dist"))


def test_every_config_file_ships_in_the_wheel(wheel, tmp_path):
    assert configs_left_out(wheel, ROOT / "configs") == []
    assert len(list((ROOT / "configs").rglob("*.yaml"))) >= 10
    src = copy_sources(tmp_path / "src")  # twin: a group folder that pyproject.toml does not list
    (src / "configs" / "loss").mkdir()
    (src / "configs" / "loss" / "ppo.yaml").write_text("name: ppo\n")
    assert configs_left_out(build_wheel(src, tmp_path / "dist"), src / "configs") == ["configs/loss/ppo.yaml"]


# what `rlalign train` imports on its documented paths (Ray actors; a model directory's tokenizer)
TRAIN_NEEDS = {"torch", "ray", "transformers", "tokenizers", "hydra-core", "omegaconf", "safetensors", "numpy"}


def core_requirements(metadata: str) -> set[str]:
    """The distributions a wheel's METADATA requires without an extra (what a plain install brings)."""
    return {re.split(r"[\[=<>!~;\s]", ln.removeprefix("Requires-Dist:").strip())[0].lower()
            for ln in metadata.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln}


def test_a_plain_install_brings_what_rlalign_train_imports(wheel):
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert TRAIN_NEEDS - core_requirements(metadata) == set()
    # twin: Ray under an extra, which a plain install leaves out
    ray = "Requires-Dist: ray[default]==2.60.0"
    as_extra = metadata.replace(ray, f'{ray}; extra == "ray"')
    assert as_extra != metadata and TRAIN_NEEDS - core_requirements(as_extra) == {"ray"}


def _fresh_venv(where: Path, wheel: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    site = Path(subprocess.run([str(where / "bin" / "python"), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(where / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    return site


def test_the_wheel_runs_from_another_directory_in_a_fresh_venv(wheel, tmp_path):
    site = _fresh_venv(tmp_path / "venv", wheel)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def rlalign(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(tmp_path / "venv" / "bin" / "rlalign"), *argv], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)

    p = rlalign("--version")
    assert p.returncode == 0 and p.stdout.startswith(f"rlalign 0.1.0 ({site / 'rlalign'};"), p.stdout + p.stderr
    p = rlalign("train", "--cfg", "job")
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout)["model"]["name"] == "tiny-moe"
    (work / "conf" / "model").mkdir(parents=True)
    (work / "conf" / "model" / "my-moe.yaml").write_text("num_layers: 1\n")
    p = rlalign("train", "--cfg", "job", "--config-dir", "conf", "model=my-moe")
    assert p.returncode == 0 and yaml.safe_load(p.stdout)["model"]["num_layers"] == 1, p.stderr
    p = rlalign("agree", *TINY_AGREE)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["mismatched_tokens"] == 0
    shutil.rmtree(site / "rlalign" / "configs")  # twin: the same install without its packaged configs
    p = rlalign("train", "--cfg", "job")
    assert p.returncode == 2 and not p.stdout and "rlalign train: error: " in p.stderr and str(ROOT) not in p.stderr
