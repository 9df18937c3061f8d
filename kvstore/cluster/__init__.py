"""Several store nodes as one pool: membership in Redis with TTL heartbeats
(:mod:`kvstore.cluster.membership`), a node's cluster presence (:mod:`kvstore.cluster.agent`),
placement by free capacity (:mod:`kvstore.cluster.placement`), the client that places, finds
and reads blocks across the live nodes (:mod:`kvstore.cluster.client`) and a private
``redis-server`` for a one-host cluster (:mod:`kvstore.cluster.redis_server`)."""
from kvstore.cluster.membership import LocalRegistry, NodeInfo, RedisRegistry, Registry, registry_for

__all__ = ["LocalRegistry", "NodeInfo", "RedisRegistry", "Registry", "registry_for"]
