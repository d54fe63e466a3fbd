# syntax=docker/dockerfile:1
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[speed]"

FROM python:3.11-slim
RUN groupadd --system gateway && useradd --system --gid gateway --home /nonexistent \
        --shell /usr/sbin/nologin gateway
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY policies /etc/gateway/policies
# Operators mount their own policy directory here; the gateway watches it for edits.
VOLUME ["/etc/gateway/policies"]
ENV GATEWAY_CONFIG=/etc/gateway/policies/default.yaml \
    PYTHONUNBUFFERED=1
USER gateway
EXPOSE 8080 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9090/readyz', timeout=2).status == 200 else 1)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["gateway", "run"]
CMD ["--listen", "0.0.0.0:8080", "--admin-listen", "0.0.0.0:9090"]
