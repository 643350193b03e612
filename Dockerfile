# quire on Debian 12: one image for every role (`quire zk run`, `quire
# bookie run`, `quire broker run`, ...), with Debian's ZooKeeper and a Java
# runtime, quire in a virtual environment, and no build tools or test
# dependencies. scripts/docker-build builds it where Docker Hub cannot be
# reached (a debootstrap base, wheels built on the host); where it can,
# `docker-compose build` works as well.
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
# Wheels built on the host (scripts/docker-build), if any: then nothing is
# downloaded here.
COPY .docker-wheels /wheels
COPY pyproject.toml README.md /src/
COPY coordination /src/coordination
COPY framing /src/framing
COPY security /src/security
COPY bookie /src/bookie
COPY ledger_client /src/ledger_client
COPY broker /src/broker
COPY sim /src/sim
COPY quire /src/quire
COPY bench /src/bench
RUN python3 -m venv /opt/quire \
 && if ls /wheels/quire-*.whl >/dev/null 2>&1; then \
        /opt/quire/bin/pip install --no-cache-dir --no-index --find-links /wheels quire; \
    else \
        /opt/quire/bin/pip install --no-cache-dir /src; \
    fi \
 && /opt/quire/bin/pip uninstall --yes --quiet pip setuptools

FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 default-jre-headless zookeeper \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && useradd --system --create-home --home-dir /home/quire --shell /usr/sbin/nologin quire \
 && mkdir -p /data/zookeeper \
 && chown -R quire:quire /data
COPY --from=build /opt/quire /opt/quire
ENV PATH=/opt/quire/bin:$PATH PYTHONUNBUFFERED=1
USER quire
WORKDIR /data
ENTRYPOINT ["quire"]
