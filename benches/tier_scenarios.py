"""The scenarios of the tier throughput bench: for each ``--tiers`` key, the cases it measures and their limits.

One function per family of tiers (process memory, device memory, disks,
remote stores), each building :class:`tier_common.Case` objects from the
command line's options; :data:`SCENARIOS` maps every key to its function, in
the order the bench runs them. benches/tier_throughput.py runs the cases.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from common import MIB, REPO, files_under
from tier_common import ArrowLimit, Case, CudaLimit, DiskLimit, Limit, MemcpyLimit

from asymstore.format.names import version_dirname
from asymstore.testing_s3 import LoopbackS3
from asymstore.tiers import GPUTier, LocalTier, NVMeTier, RemoteTier, Tier, host_tier

STUB_LIBCUDA = REPO / "tests" / "support" / "stub_libcuda.c"
TEMP_DIRS: list[str] = []  # made by the scenarios; the bench removes them at exit


@dataclass
class Setup:
    """What every scenario builds its cases from: the options, the dd buffer, the environment record, S3."""

    args: argparse.Namespace
    dd_buf: mmap.mmap
    env: dict[str, Any]  # the JSON's environment: scenarios note what they used or skipped
    s3: LoopbackS3 | None  # the loopback S3 server, when remote-s3 is among the tiers

    @property
    def nbytes(self) -> int:
        """Bytes per version on memory and disk tiers."""
        return int(self.args.size_mib) * MIB

    @property
    def mem_cap(self) -> int:
        """Capacity of the in-memory tiers: one version and some slack."""
        return self.nbytes + 64 * MIB

    def case_dir(self, key: str) -> str:
        """The case's own directory under ``--dir``."""
        return os.path.join(self.args.dir, key)


# -- memory ----------------------------------------------------------------------


def host_cases(key: str, setup: Setup) -> list[Case]:
    """host_tier in process memory against memcpy into preallocated memory."""
    nbytes = setup.nbytes
    mem_cap = setup.mem_cap
    return [Case(key, "host_tier (process memory)", nbytes, lambda: host_tier(mem_cap),
                 lambda _t: MemcpyLimit(nbytes), warm_up=True)]


def gpu_cases(key: str, setup: Setup) -> list[Case]:
    """GPUTier against host<->device copies (memcpy on the CPU device where there is no CUDA)."""
    nbytes = setup.nbytes
    mem_cap = setup.mem_cap
    cuda = torch.cuda.is_available()
    label = "GPUTier (cuda)" if cuda else "GPUTier (no CUDA: cpu device)"

    def gpu_limit(_t: Tier) -> Limit:
        return CudaLimit(nbytes, torch.device("cuda")) if cuda else MemcpyLimit(nbytes)
    return [Case(key, label, nbytes, lambda: GPUTier(mem_cap), gpu_limit, warm_up=True)]


# -- disks -----------------------------------------------------------------------


def ensure_libcuda() -> str:
    """Make ``libcuda.so.1`` loadable for kvikio: the real driver, else the test stub built with gcc."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return "real libcuda.so.1"
    except OSError:
        pass
    if shutil.which("gcc") is None:
        raise RuntimeError("no libcuda.so.1 and no gcc to build tests/support/stub_libcuda.c")
    out = os.path.join(tempfile.mkdtemp(prefix="asym-stubcuda-"), "libcuda.so.1")
    TEMP_DIRS.append(os.path.dirname(out))  # removed at exit; the loaded library stays mapped
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", out, str(STUB_LIBCUDA)],
                   check=True)
    ctypes.CDLL(out, mode=ctypes.RTLD_GLOBAL)
    return f"stub libcuda.so.1 built from tests/support/stub_libcuda.c at {out} (kvikio compat mode, POSIX I/O)"


def version_files(tier: Tier, step: int) -> list[str]:
    """The files of version ``step`` of a directory tier (LocalTier, NVMeTier)."""
    assert isinstance(tier, LocalTier)
    return files_under(os.path.join(tier.root, version_dirname(step)))


def disk_cases(key: str, setup: Setup) -> list[Case]:
    """NVMeTier (``nvme-posix``, ``nvme-kvikio``) or LocalTier (``local``) against O_DIRECT dd in ``--dir``."""
    case_dir = setup.case_dir(key)
    notes = []
    if key == "nvme-kvikio":
        try:
            setup.env["libcuda"] = ensure_libcuda()
            import kvikio  # noqa: F401  (fails early when kvikio is not installed)
        except Exception as exc:  # no kvikio, no gcc: the case is skipped, with the reason
            setup.env["skipped"][key] = f"{type(exc).__name__}: {exc}"
            print(f"skipping {key}: {exc}", flush=True)
            return []
        notes.append(setup.env["libcuda"])
    engine = "" if key == "local" else key.split("-")[1]

    def make(root: str = case_dir, engine: str = engine) -> Tier:
        path = os.path.join(root, "tier")
        return NVMeTier(path, engine=engine) if engine else LocalTier(path)
    label = f"NVMeTier ({engine} engine)" if engine else "LocalTier"
    dd_buf = setup.dd_buf
    return [Case(key, label, setup.nbytes, make, lambda _tier: DiskLimit(case_dir, dd_buf), cold_files=version_files,
                 notes=notes)]


# -- remote stores -----------------------------------------------------------------


def remote_file_files(tier: Tier, step: int) -> list[str]:
    """The files of version ``step`` of a ``file://`` RemoteTier."""
    assert isinstance(tier, RemoteTier)
    return files_under(os.path.join(tier.root, version_dirname(step)))


def _verify_suffix(verify: str) -> str:
    return "" if verify == "checksum" else f"-{verify}"  # no brackets: URIs are parsed


def remote_file_cases(key: str, setup: Setup) -> list[Case]:
    """RemoteTier on ``file://`` under ``--dir``, one case per ``--remote-verify`` mode, against a pyarrow copy."""
    cases = []
    for verify in setup.args.remote_verify:
        suffix = _verify_suffix(verify)
        root = os.path.abspath(os.path.join(setup.case_dir(key) + suffix, "tier"))

        def make_file(root: str = root, verify: str = verify) -> Tier:
            return RemoteTier(f"file://{root}", verify=verify)

        def file_limit(tier: Tier, root: str = root) -> Limit:
            assert isinstance(tier, RemoteTier)
            path = os.path.join(os.path.dirname(root), "limit.bin")
            return ArrowLimit(tier.fs, path, path)
        cases.append(Case(key + suffix, f"RemoteTier file:// (verify={verify})", setup.nbytes, make_file,
                          file_limit, cold_files=remote_file_files))
    return cases


def remote_s3_cases(key: str, setup: Setup) -> list[Case]:
    """RemoteTier on the loopback moto S3 server, one case per ``--remote-verify`` mode, against a pyarrow copy."""
    assert setup.s3 is not None
    cases = []
    for verify in setup.args.remote_verify:
        uri = setup.s3.uri(f"bench-{uuid.uuid4().hex[:8]}")

        def make_s3(uri: str = uri, verify: str = verify) -> Tier:
            return RemoteTier(uri, verify=verify)

        def s3_limit(tier: Tier) -> Limit:
            assert isinstance(tier, RemoteTier)
            return ArrowLimit(tier.fs, f"{tier.root}-limit.bin", None)
        cases.append(Case(key + _verify_suffix(verify), f"RemoteTier S3/moto (verify={verify})",
                          int(setup.args.s3_size_mib) * MIB, make_s3, s3_limit,
                          notes=["moto keeps objects in its process memory: reads are not cold"]))
    return cases


SCENARIOS: dict[str, Callable[[str, Setup], list[Case]]] = {
    "host": host_cases,
    "gpu": gpu_cases,
    "nvme-posix": disk_cases,
    "nvme-kvikio": disk_cases,
    "local": disk_cases,
    "remote-file": remote_file_cases,
    "remote-s3": remote_s3_cases,
}
ALL_TIERS = tuple(SCENARIOS)


def build_cases(setup: Setup) -> list[Case]:
    """The cases of the tiers selected by ``--tiers``, in that order."""
    return [case for key in setup.args.tiers for case in SCENARIOS[key](key, setup)]
