"""moto's S3 server on loopback, authentication enforced: only its first requests (creating an
IAM user, its policy and its access key) go unchecked, every later one must be signed with that
key. Shared by the tests that keep run directories on ``s3://`` (tests/spark/test_objstore.py,
tests/cluster/test_airflow.py). A driver is configured the AWS way (:meth:`S3.env`), nothing else."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import boto3  # comes with moto[server], in the dev extra: a missing install fails here, not skips

BUCKET = "runs"
FREE_REQUESTS = 3  # CreateUser, PutUserPolicy, CreateAccessKey: then moto checks every request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3:
    def __init__(self, url: str, key: str, secret: str, home: str):
        self.url, self.key, self.secret, self.home = url, key, secret, home

    def env(self, base: dict | None = None, **changes) -> dict:
        """The environment of a driver using this server: the AWS variables and nothing of this
        machine's own AWS setup (no profile, no config file, no instance metadata)."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=self.key, AWS_SECRET_ACCESS_KEY=self.secret, AWS_ENDPOINT_URL=self.url,
                   AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
                   AWS_CONFIG_FILE=os.path.join(self.home, "none"),
                   AWS_SHARED_CREDENTIALS_FILE=os.path.join(self.home, "none"),
                   TF_CPP_MIN_LOG_LEVEL="2")
        env.update(changes)
        return env

    def client(self):
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=self.key, aws_secret_access_key=self.secret)

    def keys(self, prefix: str) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def read(self, key: str) -> bytes:
        return self.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()


@contextlib.contextmanager
def s3_server(home: str):
    """moto's server on a free loopback port, bucket ``runs`` made with the IAM key it issued;
    stopped on exit. Checks that a wrong secret is refused before it yields."""
    port = _free_port()
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(FREE_REQUESTS))
    log = open(os.path.join(home, "moto.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    with open(os.path.join(home, "moto.log"), errors="replace") as fh:
                        raise RuntimeError(f"moto's server did not start:\n{fh.read()[-3000:]}") from None
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        iam.create_user(UserName="sparkcnn")
        iam.put_user_policy(UserName="sparkcnn", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="sparkcnn")["AccessKey"]
        server = S3(url, key["AccessKeyId"], key["SecretAccessKey"], home)
        server.client().create_bucket(Bucket=BUCKET)
        try:
            boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=server.key,
                         aws_secret_access_key="wrong").list_objects_v2(Bucket=BUCKET)
        except Exception as e:  # auth is on
            assert any(m in str(e) for m in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied",
                                             "403")), e
        else:
            raise AssertionError("moto's server accepted a wrong secret")
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
