# agentenv server image: one image for every role (serve | node | gateway | scheduler).
#
#   docker build -t agentenv:latest .        (or podman build; CI: tests/packaging/test_container_image.py)
#   docker run --privileged -v /var/lib/agentenv:/var/lib/agentenv -p 3000:3000 agentenv:latest serve
#
# Roles that run sandboxes (`serve`, `node`) need --privileged (network namespaces, nftables,
# overlay mounts, gVisor) and a persistent /var/lib/agentenv; gateway and scheduler need neither.
# The host setup is the same script a bare-metal install uses (scripts/setup.sh), so the image and
# `deploy/install.sh` cannot drift apart.
#
# BASE_IMAGE: any Debian 12 root filesystem; CI builds FROM a local import of the debootstrap base
# image agentenv already builds (no registry needed; see docs/packaging.md).
ARG BASE_IMAGE=debian:bookworm-slim
# hadolint ignore=DL3006
FROM ${BASE_IMAGE}

# Building behind a TLS-intercepting proxy: hand the RUN steps the host's CA bundle, kept out of the
# image (a build volume + these two build args, which are environment only while building):
#   -v /etc/ssl/certs:/run/agentenv-build:ro \
#   --build-arg PIP_CERT=/run/agentenv-build/ca-certificates.crt \
#   --build-arg NPM_CONFIG_CAFILE=/run/agentenv-build/ca-certificates.crt
ARG PIP_CERT
ARG NPM_CONFIG_CAFILE

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    AGENTENV_DATA_DIR=/var/lib/agentenv \
    AGENTENV_HOST=0.0.0.0 \
    AGENTENV_PORT=3000

# python3-venv for the virtualenv; the rest comes from scripts/setup.sh (runsc, debootstrap, nftables, ...).
# Unpinned on purpose: bookworm-slim + bookworm's security updates are the pin.
# hadolint ignore=DL3008
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/agentenv
# Dependencies first, from only the files that choose them (apt packages, Python dependencies at
# constraints.txt's versions, the console's npm packages): this layer stays cached while the source
# changes.
COPY scripts/setup.sh ./scripts/
COPY agentenv/hostsetup/host-packages.sh ./agentenv/hostsetup/
COPY agentenv/console/package.json agentenv/console/package-lock.json ./agentenv/console/
COPY pyproject.toml constraints.txt ./
RUN bash scripts/setup.sh --deps-only \
    && rm -rf /var/lib/apt/lists/* /root/.cache/pip /root/.npm
# Then agentenv itself (setup.sh finds the packages above installed and only installs the project).
COPY pyproject.toml setup.py constraints.txt README.md LICENSE ./
COPY agentenv ./agentenv
COPY scripts ./scripts
RUN bash scripts/setup.sh \
    && rm -rf /var/lib/apt/lists/* /root/.cache/pip \
    && ln -s /opt/agentenv/.venv/bin/agentenv /usr/local/bin/agentenv

VOLUME ["/var/lib/agentenv"]
EXPOSE 3000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/opt/agentenv/.venv/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('AGENTENV_PORT', '3000'), timeout=4)"]
ENTRYPOINT ["agentenv"]
CMD ["serve"]
