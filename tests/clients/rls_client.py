#!/usr/bin/env python3
"""Calls ShouldRateLimit through Envoy's own generated Python stubs (PyPI `xds-protos`, with
`grpcio`), as a real third-party client of sluice.

Usage: rls_client.py TARGET [CA_PEM]   (TLS when CA_PEM is given, else plaintext)

Reads one call per line on stdin, as JSON: {"domain": "...", "descriptors": [[["key", "value"],
...], ...], "hits_addend": N (optional)}. Writes one JSON line per call: {"code": "OK" |
"OVER_LIMIT", "statuses": [{"code": ..., "remaining": N}, ...]} or {"error": "UNAVAILABLE",
"message": "..."} when the call fails.
"""
import json
import sys

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc


def request(call):
    descriptors = []
    for entries in call["descriptors"]:
        descriptors.append(
            ratelimit_pb2.RateLimitDescriptor(
                entries=[
                    ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries
                ]
            )
        )
    return rls_pb2.RateLimitRequest(
        domain=call["domain"],
        descriptors=descriptors,
        hits_addend=call.get("hits_addend", 0),
    )


def main():
    target = sys.argv[1]
    if len(sys.argv) > 2:
        with open(sys.argv[2], "rb") as f:
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(target)
    code_name = rls_pb2.RateLimitResponse.Code.Name
    with channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                r = stub.ShouldRateLimit(request(json.loads(line)), timeout=10)
                out = {
                    "code": code_name(r.overall_code),
                    "statuses": [
                        {"code": code_name(s.code), "remaining": s.limit_remaining}
                        for s in r.statuses
                    ],
                }
            except grpc.RpcError as e:
                out = {"error": e.code().name, "message": e.details()}
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
