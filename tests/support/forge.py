"""What a forger (or a test standing in for one) does after editing a version's bytes: fix its checksums."""

from __future__ import annotations

from typing import Any

from asymstore.format.checksum import StreamingChecksum
from asymstore.format.proof import chunks_digest


def reprove(doc: dict[str, Any], segment: str, data: bytes | bytearray) -> None:
    """Set the checksum of this version's own ``segment`` in the manifest ``doc`` to what ``data`` now proves.

    By its proof: the bytes' xxh3, or (format 5, ``"proof": "chunks"``) the digest of the chunk spans the
    manifest lists in it (their checksums as ``doc`` has them now).
    """
    for seg in doc["segments"]:
        if seg["name"] != segment or "step" in seg:
            continue
        if seg.get("proof", "bytes") == "bytes":
            seg["checksum"] = StreamingChecksum([memoryview(data)]).hexdigest()
            continue
        chunks = [c for t in doc["tensors"].values() for c in t.get("chunks", [])] + list(doc.get("packs", []))
        spans = [(int(c["offset"]), int(c["length"]), str(c["checksum"])) for c in chunks
                 if c["segment"] == segment and "step" not in c]
        seg["checksum"] = chunks_digest(spans, int(seg["size"]))
