# One image for every dracap service (claims API, reservation, relay, reclamation, node
# agent, migrations): `docker build -t dracap .`, then `docker run dracap COMMAND ...`.
# Built from the project's own files only; runs as an unprivileged user by default (the
# node agent's container adds NET_ADMIN and runs as root where tc needs it; see
# docker-compose.yml).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY events ./events
COPY services ./services
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
# iproute2: tc and ip for the node agent's bandwidth enforcer; nothing else is installed
RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/dracap --create-home dracap
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER dracap
WORKDIR /var/lib/dracap
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["dracap"]
CMD ["--help"]
