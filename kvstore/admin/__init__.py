"""The store node's Admin API: operations on the pool's books (ops), the gRPC service that
serves them on the node's port behind the store token (service) and its client (client)."""
