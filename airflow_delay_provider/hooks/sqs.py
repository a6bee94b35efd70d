"""SqsDelayHook: the amazon provider's SqsHook, opening the SQS delay transport on an `aws` connection."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from airflow.sdk.exceptions import AirflowNotFoundException

from airflow_delay_provider.core.errors import ConnectionSetupError
from airflow_delay_provider.extras import optional_feature_error

try:
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    from airflow.providers.amazon.aws.hooks.sqs import SqsHook
    from botocore.exceptions import NoRegionError

    from airflow_delay_provider.transports.sqs import (
        DELAY_QUEUE_SUFFIX,
        FIFO_DELAY_QUEUE_SUFFIX,
        NATIVE_MAX_DELAY,
        SqsTransport,
    )
except ImportError as error:  # installed without the [amazon] extra
    raise optional_feature_error("amazon", error) from error


class SqsDelayHook(SqsHook):
    """An SqsHook (same `aws` connection: credentials, region, `endpoint_url`) that also builds the transport.

    Takes SqsHook's arguments, `aws_conn_id` (default `aws_default`) among them. With a
    `large_body_bucket`, bodies too large for SQS go to that S3 bucket through the same connection.
    """

    @cached_property
    def conn(self) -> Any:
        """The SQS client; without a region anywhere (connection, AWS_DEFAULT_REGION, AWS config file) an error that
        says what to create, instead of botocore's NoRegionError."""
        try:
            return super().conn
        except NoRegionError as error:
            raise ConnectionSetupError(self._no_region()) from error

    def _no_region(self) -> str:
        conn_id = self.aws_conn_id
        try:
            defined = bool(conn_id) and self.get_connection(conn_id) is not None
        except AirflowNotFoundException:
            defined = False
        create = (f"airflow connections add {conn_id or 'aws_default'} --conn-type aws "
                  "--conn-extra '{\"region_name\": \"eu-west-1\"}'")
        if conn_id is None:
            return ("SQS needs an AWS region: no aws connection was given (aws_conn_id=None) and the environment names "
                    "no region: set AWS_DEFAULT_REGION where the tasks and the triggerer run, or name a connection "
                    f"with one ({create})")
        if not defined:
            return (f"SQS needs an AWS region and credentials, and the aws connection {conn_id!r} is not defined: "
                    f"create it ({create}, with --conn-login/--conn-password for access keys or without them for the "
                    "machine's own credentials), or set AWS_DEFAULT_REGION where the tasks and the triggerer run")
        return (f"SQS needs an AWS region, and the aws connection {conn_id!r} names none: add region_name to its "
                f"extra (as in {create}), or set AWS_DEFAULT_REGION where the tasks and the triggerer run")

    @classmethod
    def for_transport(cls, conn_id: str, db_schema: str | None = None) -> SqsDelayHook:
        """The hook of a `transport="sqs"` connection (see the transport registry); no db_schema."""
        return cls(aws_conn_id=conn_id)

    def get_transport(
        self, prefix: str = "", queue_delay: int = NATIVE_MAX_DELAY, large_body_bucket: str | None = None,
        **options: Any,
    ) -> SqsTransport:
        """The SQS transport on this connection: `prefix` of its queue names, `queue_delay` (Q, 1..900 s)
        the longest delay a message waits in its endpoint queue (longer ones cycle through the endpoint's
        `-delay.fifo` queue), `large_body_bucket` for bodies too large for SQS, and the other
        `transport_options` of the transport registry."""
        s3 = None
        if large_body_bucket:
            s3 = AwsBaseHook(aws_conn_id=self.aws_conn_id, client_type="s3").get_conn()
        return SqsTransport(self.get_conn(), prefix=prefix, queue_delay=queue_delay,
                            large_body_bucket=large_body_bucket, s3_client=s3, **options)

    def transport_spec(self, **options: Any) -> dict:
        """The connection as plain data for a process without Airflow (a Spark sweep's executors), with the
        transport options; holds secrets.

        Credentials travel so that they never expire mid-sweep: a connection's own keys as they are; a
        `role_arn` (assume_role) as the role, which the executors assume themselves and botocore refreshes
        before expiry; none at all when the connection has neither, so that executors use their own
        node's credentials (instance profile, IRSA, environment), which refresh themselves. Only roles
        assumed another way (SAML, web identity) or a profile go as the credentials of the moment, with
        a warning that they expire."""
        conn = self.conn_config
        client: dict[str, Any] = {"region_name": self.conn_region_name, "endpoint_url": conn.endpoint_url}
        keys = {"aws_access_key_id": conn.aws_access_key_id, "aws_secret_access_key": conn.aws_secret_access_key,
                "aws_session_token": conn.aws_session_token}
        spec: dict[str, Any] = {**options, "kind": "sqs", "client": client}
        if conn.role_arn and conn.assume_role_method in (None, "assume_role"):
            client.update({k: v for k, v in keys.items() if v})
            spec["assume_role"] = {
                "role_arn": conn.role_arn,
                "kwargs": {"RoleSessionName": f"airflow-delay-sweep-{conn.conn_id}"[:64], **conn.assume_role_kwargs},
                "sts_endpoint_url": conn.get_service_endpoint_url("sts", sts_connection_assume=True),
            }
        elif conn.aws_access_key_id:
            client.update(keys)
        elif conn.role_arn or conn.profile_name:
            credentials = self.get_credentials()
            client.update(aws_access_key_id=credentials.access_key, aws_secret_access_key=credentials.secret_key,
                          aws_session_token=credentials.token)
            self.log.warning(
                "The connection %s gets its credentials by %s: the executors get the temporary credentials of this "
                "moment, which expire (commonly after an hour). Give it a role_arn with assume_role, or give the "
                "cluster's nodes credentials of their own and the connection none.",
                conn.conn_id, conn.assume_role_method if conn.role_arn else f"profile {conn.profile_name!r}")
        return spec

    def test_connection(self) -> tuple[bool, str]:
        """Reach SQS with the connection's credentials and list the queues the provider can use."""
        try:
            urls = self.get_conn().list_queues(MaxResults=1000).get("QueueUrls", [])
        except Exception as exc:  # shown in the UI; botocore's messages carry no secret key
            return False, f"{type(exc).__name__}: {exc}"
        delay_queues = sum(url.endswith(DELAY_QUEUE_SUFFIX) for url in urls)
        fifo_delay_queues = sum(url.endswith(FIFO_DELAY_QUEUE_SUFFIX) for url in urls)
        where = self.conn_config.endpoint_url or f"region {self.conn_region_name}"
        text = f"Reached SQS at {where}; {len(urls)} queue(s), {delay_queues} of them -delay.fifo relay queues"
        if fifo_delay_queues:
            text += f" and {fifo_delay_queues} -fifo-delay relay queues (of FIFO endpoints)"
        return True, text
