# approvald: one static-ish binary on a slim Debian.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock rustfmt.toml clippy.toml ./
COPY src src
COPY migrations migrations
COPY config config
COPY tests tests
RUN cargo build --release --locked --bin approvald

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/approvald /usr/local/bin/approvald
USER 65534:65534
EXPOSE 8080
ENTRYPOINT ["approvald"]
CMD ["serve"]
