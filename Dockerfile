# agentenv server image: one image for every role (serve | node | gateway | scheduler).
#
#   docker build -t agentenv:latest .
#   docker run --privileged -v /var/lib/agentenv:/var/lib/agentenv -p 3000:3000 agentenv:latest serve
#
# Roles that run sandboxes (`serve`, `node`) need --privileged (network namespaces, nftables,
# overlay mounts, gVisor) and a persistent /var/lib/agentenv; gateway and scheduler need neither.
# The host setup is the same script a bare-metal install uses (scripts/setup.sh), so the image and
# `deploy/install.sh` cannot drift apart.
FROM debian:bookworm-slim

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
