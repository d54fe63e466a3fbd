# syntax=docker/dockerfile:1
FROM python:3.11-slim AS build
# A C compiler: the gateway's wheel is the compiled build (mypyc, see setup.py). Only this
# stage has it; the image below installs the wheel and needs none.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Third-party packages exactly as locked, every file checked against its hash
# (requirements.lock, made by pip-compile from pyproject.toml; see the README); the gateway
# itself is built from this source without resolving anything.
COPY requirements.lock ./
RUN pip wheel --no-cache-dir --require-hashes --wheel-dir /wheels -r requirements.lock
# mypyc type-checks the compiled modules against those same locked packages.
RUN pip install --no-cache-dir --no-index --find-links /wheels -r requirements.lock \
    && pip install --no-cache-dir "setuptools>=68" wheel mypy==2.4.1 types-PyYAML
COPY pyproject.toml setup.py README.md ./
COPY gateway ./gateway
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

FROM python:3.11-slim
# A fixed numeric uid, so Kubernetes' runAsNonRoot can check it (deploy/kubernetes/). The
# admin token's directory is the gateway user's, so the token can be written there (a volume
# mounted on it starts with this owner).
RUN groupadd --system --gid 10001 gateway && useradd --system --uid 10001 --gid gateway \
        --home /nonexistent --shell /usr/sbin/nologin gateway \
    && install -d -o gateway -g gateway -m 0700 /run/gateway
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --no-deps /wheels/*.whl && rm -rf /wheels \
    && gateway --version | grep -F "(compiled)"
# The image's own policies live outside /etc/gateway/policies, so mounting a policy directory
# there does not hide the default; point GATEWAY_CONFIG (or --config) at a mounted file.
COPY policies /usr/local/share/gateway/policies
# Settings come from the environment, not from CMD, so `docker run IMAGE --config FILE` and a
# policy copied from default.yaml (which listens on 127.0.0.1) still listen on every interface:
#   GATEWAY_CONFIG        policy file (default: the image's demo policy)
#   GATEWAY_LISTEN        proxy listener, over server.listen
#   GATEWAY_ADMIN_LISTEN  admin listener, over server.admin_listen
#   GATEWAY_IN_CONTAINER  a loopback listener is logged as unreachable
#   GATEWAY_ADMIN_TOKEN_AUTO_FILE  with no admin token given (GATEWAY_ADMIN_TOKEN, _FILE or the
#                         policy's), the admin listener off loopback gets a random one, written
#                         here and kept: `docker exec CONTAINER cat /run/gateway/admin-token`
# `gateway healthcheck` probes /readyz on GATEWAY_ADMIN_LISTEN (or the policy's admin_listen).
ENV GATEWAY_CONFIG=/usr/local/share/gateway/policies/default.yaml \
    GATEWAY_LISTEN=0.0.0.0:8080 \
    GATEWAY_ADMIN_LISTEN=0.0.0.0:9090 \
    GATEWAY_ADMIN_TOKEN_AUTO_FILE=/run/gateway/admin-token \
    GATEWAY_IN_CONTAINER=1 \
    PYTHONUNBUFFERED=1
USER gateway
EXPOSE 8080 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["gateway", "healthcheck"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["gateway", "run"]
CMD []
