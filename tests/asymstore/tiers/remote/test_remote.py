"""RemoteTier specifics: HDFS rename semantics, retries on transient errors only, verified uploads, URIs."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
import torch

from asymstore import AsymStore
from asymstore.errors import PermanentRemoteError, RemoteUnavailableError, StepCommittedError
from asymstore.tiers.remote.retry import RetryPolicy, is_transient
from asymstore.tiers.remote.tier import RemoteTier, open_filesystem

QUICK = RetryPolicy(attempts=4, deadline_s=5.0, initial_s=0.01, max_backoff_s=0.05)


class LocalHandler(pafs.FileSystemHandler):
    """A pyarrow filesystem over a local directory whose behaviour tests can change (fault injection)."""

    def __init__(self) -> None:
        self.fs = pafs.LocalFileSystem()
        self.fail_writes = 0          # next N output streams raise a transient error
        self.fail_message = "Connection reset by peer"
        self.corrupt_writes = 0       # next N output streams store a flipped byte
        self.hdfs_rename = False      # refuse a rename onto an existing destination, like HDFS
        self.writes = 0

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    def get_type_name(self) -> str:
        return "test-local"

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.fs.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("refused")

    def delete_file(self, path: str) -> None:
        self.fs.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        if self.hdfs_rename and self.fs.get_file_info(dest).type != pafs.FileType.NotFound:
            raise OSError(f"rename {src} -> {dest}: destination exists")
        self.fs.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        return self.fs.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        return self.fs.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        self.writes += 1
        if self.fail_writes:
            self.fail_writes -= 1
            raise OSError(self.fail_message)
        if self.corrupt_writes and path.endswith(".bin"):
            self.corrupt_writes -= 1
            return pa.PythonFile(_Corrupting(self.fs.open_output_stream(path)), mode="w")
        return self.fs.open_output_stream(path)

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        return self.fs.open_append_stream(path)


class _Corrupting:
    """An output stream that flips the first byte it is given (a bad upload)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.first = True

    def write(self, data: Any) -> int:
        data = bytearray(data)
        if self.first and data:
            data[0] ^= 0xFF
            self.first = False
        return int(self.inner.write(data))

    def close(self) -> None:
        self.inner.close()

    def flush(self) -> None:
        self.inner.flush()

    @property
    def closed(self) -> bool:
        return bool(self.inner.closed)

    def __enter__(self) -> _Corrupting:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def handler() -> LocalHandler:
    return LocalHandler()


def tier(handler: LocalHandler, root: str, **kw: Any) -> RemoteTier:
    return RemoteTier(root, filesystem=pafs.PyFileSystem(handler), retry=QUICK, **kw)


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1000,), float(step)), "i": torch.arange(step + 1)}


async def test_hdfs_rename_semantics_publish(handler: LocalHandler, tmp_path: object) -> None:
    handler.hdfs_rename = True
    root = str(tmp_path)
    async with AsymStore([tier(handler, root, publish="rename")], compression="never") as store:
        for step in (1, 2):
            await store.put_many(step, state(step))
            await store.commit(step)  # rename to a fresh name succeeds; LATEST is replaced despite HDFS rules
        assert await store.tiers[0].read_latest() == 2
        t = store.tiers[0]
        writer = await t.begin(3, 10)
        os.makedirs(os.path.join(root, "v000000000003"))  # someone published step 3 meanwhile
        with open(os.path.join(root, "v000000000003", "MANIFEST.json"), "w") as f:
            f.write('{"another": "version"}')
        retries = t.retry.retries  # QUICK is shared by the module's tests: count from here
        with pytest.raises(StepCommittedError):
            await writer.publish(b"{}")  # the rename is refused, never replaces a version
        await writer.abort()
        assert t.retry.retries == retries  # "destination exists" is never retried as a transient error
        # the same manifest already there: an earlier attempt of this very publish got through
        shutil.rmtree(os.path.join(root, "v000000000003"))
        writer = await t.begin(3, 10)
        os.makedirs(os.path.join(root, "v000000000003"))
        with open(os.path.join(root, "v000000000003", "MANIFEST.json"), "w") as f:
            f.write("{}")
        await writer.publish(b"{}")
        assert t.retry.retries == retries  # "already there" is never retried as a transient error either
        assert not os.path.exists(writer.target)  # its own copy is gone
        shutil.rmtree(os.path.join(root, "v000000000003"))
        assert torch.equal((await store.restore()).tensors["w"], state(2)["w"])
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]


async def test_transient_errors_are_retried(handler: LocalHandler, tmp_path: object) -> None:
    t = tier(handler, str(tmp_path))
    async with AsymStore([t], compression="never") as store:
        handler.fail_writes = 2
        await store.put_many(1, state(1))
        await store.commit(1)
        assert handler.fail_writes == 0 and t.retry.retries >= 2
        assert torch.equal((await store.restore()).tensors["w"], state(1)["w"])


async def test_permanent_errors_are_raised_typed_without_retry(handler: LocalHandler, tmp_path: object) -> None:
    t = tier(handler, str(tmp_path))
    async with AsymStore([t], compression="never") as store:
        await store.put_many(1, state(1))
        await store.commit(1)
        handler.fail_writes, handler.fail_message = 5, "AWS Error ACCESS_DENIED: AccessDenied"
        before = handler.writes
        await store.put_many(2, state(2))
        with pytest.raises(PermanentRemoteError):
            await store.commit(2)
        assert handler.writes - before == 1  # not retried
        assert (await store.restore()).step == 1  # the previous version is untouched


async def test_remote_unavailable_after_deadline(handler: LocalHandler, tmp_path: object) -> None:
    t = tier(handler, str(tmp_path))
    async with AsymStore([t], compression="never") as store:
        handler.fail_writes = 100
        await store.put_many(1, state(1))
        with pytest.raises(RemoteUnavailableError):
            await store.commit(1)
        handler.fail_writes = 0
        await store.commit(1)  # the step stayed staged: a retry commits it
        assert (await store.restore()).step == 1


async def test_corrupted_upload_is_caught_by_verification(handler: LocalHandler, tmp_path: object) -> None:
    t = tier(handler, str(tmp_path))
    async with AsymStore([t], compression="never") as store:
        handler.corrupt_writes = 1
        await store.put_many(1, state(1))
        await store.commit(1)  # the read-back checksum differs; the upload is redone
        assert handler.corrupt_writes == 0 and t.retry.retries >= 1
        ckpt = await store.restore()
        assert not ckpt.fell_back and torch.equal(ckpt.tensors["w"], state(1)["w"])


async def test_s3_marker_publish_and_uri_options(s3_uri: str) -> None:
    t = RemoteTier(s3_uri)
    assert t.publish_mode == "marker" and "secret" not in t.name and "?" not in t.name
    async with AsymStore([t], compression="never") as store:
        await store.put_many(4, state(4))
        await store.commit(4)
        fs, root = t.fs, t.root
        assert fs.get_file_info(f"{root}/v000000000004/MANIFEST.json").type == pafs.FileType.File
        assert torch.equal((await store.restore()).tensors["i"], torch.arange(5))
    base, _, query = s3_uri.partition("?")
    opts = dict(kv.split("=") for kv in query.split("&"))
    async with AsymStore([RemoteTier(base, **opts)]) as store:  # the same options as keyword arguments
        assert (await store.restore()).step == 4
    with pytest.raises(ValueError):
        open_filesystem(base + "?no_such_option=1")


def test_transient_classification() -> None:
    assert is_transient(OSError("AWS Error NETWORK_CONNECTION: Could not connect"))
    assert is_transient(OSError("Connection reset by peer"))
    assert not is_transient(OSError("AccessDenied"))
    assert not is_transient(FileNotFoundError("gone"))
    assert not is_transient(ValueError("bug"))


def test_live_hdfs() -> None:
    uri = os.environ.get("ASYMSTORE_TEST_HDFS")
    if not uri:
        pytest.skip("no HDFS cluster here: set ASYMSTORE_TEST_HDFS=hdfs://namenode:port/path "
                    "(with JAVA_HOME, HADOOP_HOME and CLASSPATH for libhdfs) to run it")
    import asyncio

    async def run() -> None:
        t = RemoteTier(uri)
        assert t.publish_mode == "rename"
        async with AsymStore([t], keep_last=2) as store:
            step = (store.newest_step or 0) + 1
            await store.put_many(step, state(step))
            await store.commit(step)
            assert (await store.restore()).step == step
    asyncio.run(run())
