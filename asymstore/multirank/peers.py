"""Reading another rank's shard through its tiers (DeepSpeed's engine reads every rank's files on load)."""

from __future__ import annotations

from collections.abc import Sequence

from asymstore.errors import AsymstoreError, CorruptVersionError, describe
from asymstore.format.manifest import Manifest
from asymstore.read.load import load_version
from asymstore.read.verify import read_manifest
from asymstore.tiers.protocol import Tier
from asymstore.values import Checkpoint


async def read_peer_shard(tiers: Sequence[Tier], rank: int, step: int) -> Checkpoint:
    """Read and verify ``rank``'s shard ``step`` from the first of its unopened ``tiers`` that holds it.

    Raises:
        CorruptVersionError: no tier holds a copy that verifies (the reasons, per tier).
    """
    reasons: list[str] = []
    for tier in tiers:
        await tier.open()
        try:
            manifest, tensors = await load_version(tier, step)
            return Checkpoint(step, tensors, manifest.meta, tier.name, manifest, reasons)
        except (AsymstoreError, OSError) as exc:
            reasons.append(f"rank {rank} step {step} on {tier.name}: {describe(exc)}")
        finally:
            await tier.close()
    raise CorruptVersionError("; ".join(reasons) or f"no tier of rank {rank}")


async def read_shard_manifest(tiers: Sequence[Tier], rank: int, step: int, *, opened: bool) -> Manifest:
    """Read ``rank``'s shard manifest ``step`` from the first of ``tiers`` that holds it.

    Args:
        tiers: the rank's tiers.
        rank: the rank (for the errors).
        step: the shard's step.
        opened: the tiers are open already (this rank's own); otherwise each is opened and closed here.

    Raises:
        CorruptVersionError: no tier holds a manifest that parses (the reasons, per tier).
    """
    reasons: list[str] = []
    for tier in tiers:
        if not opened:
            await tier.open()
        try:
            return await read_manifest(tier, step)
        except (AsymstoreError, OSError) as exc:
            reasons.append(f"rank {rank} step {step} on {tier.name}: {describe(exc)}")
        finally:
            if not opened:
                await tier.close()
    raise CorruptVersionError("; ".join(reasons) or f"no tier of rank {rank}")
