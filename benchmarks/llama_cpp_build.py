"""llama.cpp's `llama-server` and `llama-bench`, built once from the llama.cpp source that ships on PyPI.

    python -m benchmarks.llama_cpp_build               # build if needed, print the binaries and their version
    python -m benchmarks.llama_cpp_build --level avx2  # llama.cpp limited to AVX2 (ggml's x86 flags off above it)

The source distribution of llama-cpp-python (`pip download --no-deps --no-binary :all:`) carries the full
llama.cpp tree under vendor/llama.cpp. It is unpacked and built with cmake (Release, no CURL/OpenSSL/web UI
download, only the two targets) into .peers/ (ignored by git): at `native` with this CPU's own flags, at
`avx2` with SSE4.2, AVX, AVX2, FMA, F16C and BMI2 only, the code llama.cpp runs on an AVX2-only CPU. A later call
reuses a level's build when both binaries are there and answer `--version`; --rebuild forces a fresh one.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / ".peers"
# Pinned so that every run of the benchmark compares with the same llama.cpp; --package overrides it.
LLAMA_CPP_PACKAGE = "llama-cpp-python==0.3.36"
TARGETS = ("llama-server", "llama-bench")
# ggml's instruction-set options per level; native: -march=native, the widest vectors this CPU has
LEVEL_OPTIONS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF"),
}
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",           # self-contained binaries, no rpath into the build tree
    "-DLLAMA_CURL=OFF",                  # older trees: no model download by URL
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",       # the web UI would otherwise be fetched from a remote bucket
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)


@dataclass(frozen=True)
class LlamaCppBuild:
    """The built binaries and what `llama-server --version` says of them (build number and commit)."""
    server: Path
    bench: Path
    version: str
    package: str
    level: str = "native"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _binary_version(path: Path) -> str | None:
    """`path --version`'s output (llama.cpp prints it on stderr), or None when the binary does not run."""
    if not path.is_file():
        return None
    try:
        done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (done.stdout + done.stderr).strip()
    return text if done.returncode == 0 and "version" in text else None


def _version_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.startswith("version")), text.splitlines()[-1])


def existing_build(build_dir: Path, package: str, level: str = "native") -> LlamaCppBuild | None:
    """The build in build_dir if both binaries are there and run, else None."""
    server, bench = build_dir / "bin" / "llama-server", build_dir / "bin" / "llama-bench"
    server_version = _binary_version(server)
    if server_version is None or _binary_version(bench) is None:
        return None
    return LlamaCppBuild(server=server, bench=bench, version=_version_line(server_version), package=package,
                         level=level)


def build_dir_of(level: str) -> Path:
    return PEERS_DIR / ("build" if level == "native" else f"build-{level}")


def _cmake() -> str:
    """A cmake on PATH, else the one the `cmake` package from PyPI installs into this interpreter's environment."""
    found = shutil.which("cmake")
    if found:
        return found
    log("no cmake on this machine: installing the `cmake` package from PyPI into this environment ...")
    subprocess.run([sys.executable, "-m", "pip", "install", "cmake"], check=True)
    beside = Path(sys.executable).parent / "cmake"
    if not beside.exists():
        raise SystemExit("error: `pip install cmake` did not put a cmake beside this interpreter")
    return str(beside)


def _download_source(package: str, download_dir: Path) -> Path:
    """The source distribution of `package` (pip download, no binary), its path."""
    download_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading the source distribution of {package} ...")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "-d", str(download_dir), package], check=True)
    archives = sorted(download_dir.glob("*.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not archives:
        raise SystemExit(f"error: pip download of {package} gave no .tar.gz in {download_dir}")
    return archives[-1]


def _stays_inside(root: Path, member: tarfile.TarInfo) -> bool:
    """A file, a directory or a link whose path (and a link's target) resolves under root."""
    target = (root / member.name).resolve()
    if not target.is_relative_to(root):
        return False
    if member.issym():
        return (target.parent / member.linkname).resolve().is_relative_to(root)
    if member.islnk():
        return (root / member.linkname).resolve().is_relative_to(root)
    return member.isfile() or member.isdir()


def _unpack_llama_cpp(archive: Path, source_dir: Path) -> Path:
    """Unpack the archive's vendor/llama.cpp tree into source_dir; the tree's path."""
    if source_dir.exists():
        shutil.rmtree(source_dir)
    source_dir.mkdir(parents=True)
    root = source_dir.resolve()
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        if not members:
            raise SystemExit(f"error: {archive.name} has no vendor/llama.cpp tree")
        unsafe = [m.name for m in members if not _stays_inside(root, m)]
        if unsafe:
            raise SystemExit(f"error: {archive.name} has members that are not plain files, directories or "
                             f"links inside the tree: {unsafe[:3]}")
        # Python 3.11.0-3.11.3 have no extraction filters (the check above is ours on every version)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(source_dir, members=members, **safe)
    trees = list(source_dir.glob("*/vendor/llama.cpp"))
    if len(trees) != 1 or not (trees[0] / "CMakeLists.txt").exists():
        raise SystemExit(f"error: no llama.cpp CMakeLists.txt under {source_dir}")
    return trees[0]


def build(package: str = LLAMA_CPP_PACKAGE, jobs: int = 2, rebuild: bool = False,
          level: str = "native") -> LlamaCppBuild:
    """The two binaries at an instruction-set level (LEVEL_OPTIONS), built now unless a working build of
    that level is already in .peers/."""
    if level not in LEVEL_OPTIONS:
        raise SystemExit(f"error: no llama.cpp build level {level!r}: expected one of {', '.join(LEVEL_OPTIONS)}")
    build_dir = build_dir_of(level)
    if not rebuild:
        found = existing_build(build_dir, package, level)
        if found is not None:
            return found
    cmake = _cmake()
    tree = _unpack_llama_cpp(_download_source(package, PEERS_DIR / "download"), PEERS_DIR / "src")
    if build_dir.exists():
        shutil.rmtree(build_dir)
    log(f"configuring llama.cpp ({level}) in {build_dir} ...")
    subprocess.run([cmake, "-S", str(tree), "-B", str(build_dir), *CMAKE_OPTIONS, *LEVEL_OPTIONS[level]],
                   check=True)
    log(f"building {', '.join(TARGETS)} with -j{jobs} (about ten minutes on two cores) ...")
    subprocess.run([cmake, "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
                    "--target", *TARGETS], check=True, env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)})
    found = existing_build(build_dir, package, level)
    if found is None:
        raise SystemExit(f"error: the build finished but {build_dir}/bin has no working {' and '.join(TARGETS)}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", default=LLAMA_CPP_PACKAGE, help="the PyPI requirement whose sdist holds llama.cpp")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    parser.add_argument("--rebuild", action="store_true", help="build again even if a working build exists")
    parser.add_argument("--level", default="native", choices=sorted(LEVEL_OPTIONS), help="instruction-set level")
    args = parser.parse_args()
    built = build(args.package, args.jobs, args.rebuild, args.level)
    print(f"llama-server: {built.server}\nllama-bench:  {built.bench}\n"
          f"{built.version} ({built.package}, {built.level})")


if __name__ == "__main__":
    main()
