"""GeoFP8 installs like a library: a wheel built from this tree, installed into a fresh
virtual environment that reuses the torch already installed (as a user's own environment
has it), imports from that environment and runs a 2-rank DDP step under torchrun.

The wheel's core requirements are torch and numpy only; everything else is an extra. The
fresh environment sees nothing else of this one: only torch, numpy and what they require."""

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"gpu", "report", "hf", "gguf", "integrations", "dev", "demo", "all"}

DDP_STEP = """
import datetime, json
import torch
import torch.distributed as dist
import geofp8
from geofp8 import GeoFP8Config, GeoFP8State, geofp8_hook

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
model(x).pow(2).mean().backward()
mean = [p.grad.clone() for p in model.parameters()]  # this rank's gradient ...
for g in mean:
    dist.all_reduce(g)
    g /= dist.get_world_size()  # ... averaged in FP32: the reference
model.zero_grad()
ddp = torch.nn.parallel.DistributedDataParallel(model)
state = GeoFP8State(model, GeoFP8Config())
ddp.register_comm_hook(state, geofp8_hook)
ddp(x).pow(2).mean().backward()
got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
ref = torch.cat([g.reshape(-1) for g in mean])
with open(f"rank{rank}.json", "w") as f:  # one file a rank: stdout lines could interleave
    json.dump({"rank": rank, "file": geofp8.__file__, "grad": got.tolist(),
               "rel": ((got - ref).norm() / ref.norm()).item(),
               "bytes": state.stats()["bytes_sent"]}, f)
dist.destroy_process_group()
"""


def _torch_and_numpy_only(into: Path) -> Path:
    """A folder of links to the installed torch and numpy and the distributions they require
    (by their metadata, transitively): the user's environment with no extra in it."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo = set(), ["torch", "numpy"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name not in seen:
            seen.add(name)
            for line in metadata.distribution(name).requires or []:
                req = Requirement(line)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    todo.append(req.name)
    into.mkdir()
    for name in seen:
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            if top != "__pycache__" and not top.endswith(".pth"):
                target = Path(dist.locate_file(top))
                if not (into / top).exists():
                    (into / top).symlink_to(target)
    return into


def _run(*cmd, **kw):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert done.returncode == 0, f"{cmd}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the tree (the build leaves nothing in the checkout)."""
    tree = tmp_path_factory.mktemp("tree")
    shutil.copy(ROOT / "pyproject.toml", tree)
    shutil.copy(ROOT / "README.md", tree)
    shutil.copytree(ROOT / "src", tree / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(out), str(tree))
    (found,) = out.glob("geofp8-*.whl")
    return found


def test_the_wheel_requires_only_torch_and_numpy_and_offers_the_extras(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = Parser().parsestr(zf.read(next(n for n in names
                                              if n.endswith(".dist-info/METADATA"))).decode())
    assert "geofp8/codecs/native.c" in names and "geofp8/py.typed" in names
    requires = meta.get_all("Requires-Dist")
    core = sorted(r.split(">")[0].split("<")[0].split("=")[0].strip()
                  for r in requires if "extra ==" not in r)
    assert core == ["numpy", "torch"], requires
    assert set(meta.get_all("Provides-Extra")) == EXTRAS
    dev = [r for r in requires if "extra == \"dev\"" in r]
    assert any(r.startswith("triton") for r in dev), dev  # Triton-interpreter tests run
    assert any(r.startswith("triton") for r in requires if "extra == \"gpu\"" in r)


@pytest.mark.distributed
def test_the_wheel_installs_into_an_environment_with_torch_and_runs_a_ddp_step(wheel,
                                                                              tmp_path):
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    python = env_dir / "bin" / "python"
    site = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                     "['purelib'])", env=env).strip())
    # the user's torch (and numpy), read (not copied) by the new environment
    reuse = _torch_and_numpy_only(tmp_path / "torch-and-numpy")
    (site / "reuse-installed-torch.pth").write_text(f"{reuse}\n")
    extras = _run(str(python), "-c", "import importlib.util as u; print(u.find_spec("
                  "'transformers'), u.find_spec('triton'))", env=env, cwd=tmp_path)
    assert extras.split() == ["None", "None"]  # no extra is visible to it
    _run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "-q", str(wheel))
    script = tmp_path / "step.py"
    script.write_text(DDP_STEP)
    _run(str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), env=env, cwd=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert Path(r["file"]).is_relative_to(env_dir), r["file"]  # the wheel's, not src/
        assert r["bytes"] > 0 and r["rel"] < 0.1  # FP8 of the FP32 mean: ≈ 2⁻⁴ relative
    assert ranks[0]["grad"] == ranks[1]["grad"]  # bit-identical on both ranks
    assert "geofp8" in _run(str(env_dir / "bin" / "geofp8"), "--help", env=env)
