"""Runs in a pod (e2e/cluster/smoke.sh): the API server via 10.96.0.1, S3 on the node IP, a hostPath."""

import json
import os
import ssl
import sys
import urllib.request

import boto3

ok = True
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(f"{sa}/token").read()
ns = open(f"{sa}/namespace").read()
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
host = os.environ["KUBERNETES_SERVICE_HOST"]
req = urllib.request.Request(
    f"https://{host}:443/api/v1/namespaces/{ns}/pods", headers={"Authorization": f"Bearer {token}"}
)
pods = json.load(urllib.request.urlopen(req, context=ctx, timeout=10))
print(f"API server at {host}: listed {len(pods['items'])} pods in {ns}")
ver = json.load(urllib.request.urlopen(f"https://{host}/version", context=ctx, timeout=10))
print("API server version", ver["gitVersion"])

s3 = boto3.client(
    "s3",
    endpoint_url=os.environ["S3_ENDPOINT"],
    region_name="us-east-1",
    aws_access_key_id=os.environ["S3_KEY"],
    aws_secret_access_key=os.environ["S3_SECRET"],
)
body = s3.get_object(Bucket="e2e", Key="hello.txt")["Body"].read().decode()
print("S3 object e2e/hello.txt:", body.strip())
ok &= body.strip() == "hello from s3"

hp = open("/hostdata/hello.txt").read().strip()
print("hostPath /hostdata/hello.txt:", hp)
ok &= hp == "hello from the host"
print("uid", os.getuid(), "PROBE", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
