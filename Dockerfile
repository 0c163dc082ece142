# sluice container image.
#
# NOT built by CI: the CI machine has no Docker engine. Build it wherever you have one, from the
# repository root:
#
#   docker build -t ghcr.io/sluice-rs/sluice:0.1.0 .      # the Helm chart's default image
#   docker run --rm -p 8081:8081 -p 8080:8080 ghcr.io/sluice-rs/sluice:0.1.0
#   docker run --rm -v "$PWD/config/examples:/cfg:ro" ghcr.io/sluice-rs/sluice:0.1.0 check /cfg
#
# Stage 1 builds a release binary on Debian bookworm; stage 2 copies it into distroless
# cc-debian12 (glibc + libgcc, no shell, no package manager), running as the `nonroot` user
# 65532, which the Helm chart's securityContext expects (runAsUser 65532, read-only root
# filesystem: sluice writes no files).

FROM rust:1.95-bookworm AS build
WORKDIR /src

# Dependencies first, so a change in src/ does not rebuild them: the manifest, the lock file,
# build.rs and the vendored protos it compiles, with placeholder sources. (A [[bench]] or
# [[test]] declared in Cargo.toml would need its file copied here too.)
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
RUN mkdir src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src

# The real sources. COPY keeps the files' original modification times, which can be older than
# the placeholder build: touch them and drop sluice's own fingerprints so cargo rebuilds it.
COPY src ./src
RUN touch src/main.rs src/lib.rs \
    && rm -rf target/release/.fingerprint/sluice-* \
    && cargo build --release --locked \
    && cp target/release/sluice /sluice \
    && /sluice --version

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /sluice /sluice
# The path envoyproxy/ratelimit's image uses: Envoy Gateway's rate-limit Deployment runs
# `command: [/bin/ratelimit]` and offers no way to change it (a second copy: ~17 MB).
COPY --from=build /sluice /bin/ratelimit
# Sample configs in envoyproxy/ratelimit's default runtime layout
# (RUNTIME_ROOT=/srv/runtime_data/current, RUNTIME_APPDIRECTORY=config), so the image serves
# something with no settings at all. The Helm chart mounts its ConfigMap at
# /data/ratelimit/config and sets RUNTIME_ROOT=/data RUNTIME_SUBDIRECTORY=ratelimit, so these
# are not loaded there.
COPY config/examples/*.yaml /srv/runtime_data/current/config/
USER 65532:65532
# gRPC (RateLimitService, health, reflection) and HTTP admin (/healthcheck, /json, /rlconfig,
# /metrics, /debug/offenders).
EXPOSE 8081 8080
ENTRYPOINT ["/sluice"]
# `sluice` with no subcommand also serves; `serve` is spelled out so `docker run IMAGE check
# /path` reads naturally as the alternative.
CMD ["serve"]
