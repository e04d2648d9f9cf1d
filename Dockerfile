# duebox's relay, worker and dashboard in one image; compose.yaml runs it
# (`docker compose --profile app up -d --wait`).  The entry point is the
# `duebox` command: `docker run IMAGE relay --app shop.jobs:app`.
#
# Your app's module is read from /app (the working directory, on the
# import path): mount it there (compose.yaml does), or build your own image
# on this one with your code and its requirements:
#
#   FROM duebox:dev
#   COPY --chown=duebox requirements.txt shop/ /app/
#   RUN pip install --no-cache-dir -r /app/requirements.txt
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY core core
COPY brokers brokers
COPY relay relay
COPY consumers consumers
COPY cli cli
COPY dashboard dashboard
# Every backend's driver: the broker is a setting (DUEBOX_BROKER_URL), not a build.
RUN pip install --no-cache-dir '.[postgres,mysql,redis,rabbitmq,sqs,kafka]' \
    && useradd --system --uid 10001 --home-dir /app --create-home duebox

USER duebox
WORKDIR /app
ENV PYTHONPATH=/app
ENTRYPOINT ["duebox"]
CMD ["--help"]
