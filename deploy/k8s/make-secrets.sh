#!/bin/sh
# Creates the Secrets the manifests in deploy/k8s/ reference, with fresh random values, in the
# namespace kvstore (apply 00-namespace.yaml first). The values pass through a private temporary
# directory (removed at exit), never a command line. Run it once; to rotate the values, delete the
# three Secrets, run it again and restart every pod.
#   kvstore-tokens:   store-token (store nodes, and every client of them), engine-token (the
#                     vLLM instances' API key; only the front door holds it), metrics-token
#                     (read-only: the metrics ports and the front door's /metrics)
#   kvstore-redis:    password (Redis; the services build their KVSTORE_REDIS_URL from it)
#   kvstore-api-keys: api-keys (the front door's callers' keys, one a line)
set -eu
NS=${NS:-kvstore}
umask 077
DIR=$(mktemp -d)             # the values pass through files only this user can read (not argv)
trap 'rm -rf "$DIR"' EXIT
for name in store-token engine-token metrics-token password api-keys; do
  python3 -c 'import secrets; print(secrets.token_urlsafe(32), end="")' > "$DIR/$name"
done
kubectl -n "$NS" create secret generic kvstore-tokens --from-file=store-token="$DIR/store-token" \
  --from-file=engine-token="$DIR/engine-token" --from-file=metrics-token="$DIR/metrics-token"
kubectl -n "$NS" create secret generic kvstore-redis --from-file=password="$DIR/password"
kubectl -n "$NS" create secret generic kvstore-api-keys --from-file=api-keys="$DIR/api-keys"
echo "created kvstore-tokens, kvstore-redis and kvstore-api-keys in namespace $NS;"
echo "the first API key: kubectl -n $NS get secret kvstore-api-keys -o jsonpath='{.data.api-keys}' | base64 -d"
