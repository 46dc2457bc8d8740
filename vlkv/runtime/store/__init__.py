"""The context store: checksummed, tenant-scoped records of spans' pre-RoPE K/V over device/host/disk tiers.

``record.py`` (format, checksum), ``identity.py`` (keys, model fingerprints, tenant names), ``tiers.py``
(device, host, disk) and ``store.py`` (lookup, promotion, demotion, libraries, counters).
"""

from vlkv.runtime.store.identity import (
    LAYOUT_VERSION,
    SHARED_TENANT,
    Identity,
    image_content,
    model_fingerprint,
    processor_settings,
    record_key,
    validate_key,
    validate_tenant,
)
from vlkv.runtime.store.record import CorruptRecord, Record, RecordInfo, StaleRecord
from vlkv.runtime.store.store import ContextStore, Entry, StoreStats, TierStats
from vlkv.runtime.store.tiers import DeviceTier, DiskTier, HostTier, Tier

__all__ = [
    "LAYOUT_VERSION",
    "SHARED_TENANT",
    "ContextStore",
    "CorruptRecord",
    "DeviceTier",
    "DiskTier",
    "Entry",
    "HostTier",
    "Identity",
    "Record",
    "RecordInfo",
    "StaleRecord",
    "StoreStats",
    "Tier",
    "TierStats",
    "image_content",
    "model_fingerprint",
    "processor_settings",
    "record_key",
    "validate_key",
    "validate_tenant",
]
