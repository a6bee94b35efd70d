"""Hooks: the delay store (`delay_store` connections), RabbitMQ and SQS, each giving its transport."""
