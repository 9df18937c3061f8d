"""KV events (docs/architecture.md §3.5): store nodes publish ``BlockStored``, ``BlockRemoved`` and
``NodeCleared`` with per-node sequence numbers (:class:`PublishingIndex`) to a Redis Stream,
or to an in-process channel when no Redis is configured; scheduler-side replicas of the
index (:class:`IndexReplica`) consume them, detect gaps and resynchronise from snapshots."""
from kvstore.events.channel import (
    DEFAULT_STREAM,
    EventChannel,
    LocalEventChannel,
    RedisEventChannel,
    local_channel,
    make_channel,
)
from kvstore.events.event import EventKind, KVEvent, NodeSnapshot
from kvstore.events.publisher import EventPublisher, PublishingIndex, snapshot_of
from kvstore.events.replica import IndexReplica, NodeState, ReplicaStats, store_snapshot_source

__all__ = ["DEFAULT_STREAM", "EventChannel", "LocalEventChannel", "RedisEventChannel", "local_channel",
           "make_channel", "EventKind", "KVEvent", "NodeSnapshot", "EventPublisher", "PublishingIndex",
           "snapshot_of", "IndexReplica", "NodeState", "ReplicaStats", "store_snapshot_source"]
