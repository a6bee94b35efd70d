"""Transports: queues as SQL tables, RabbitMQ and SQS; `registry` names each kind's class, hook and options."""
