"""The deployment files: the Kubernetes manifests (docker/k8s/) against the Kubernetes API's
schemas and against the server they run, and the two-replica compose example's nginx in
front of two live servers (real nginx, real woq on loopback)."""
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import LiveServer, free_port, metric_value

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "docker" / "k8s"
KUBERNETES = "1.30.0"  # the oldest release the manifests target (autoscaling/v2, policy/v1)


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def by_kind(kind: str) -> dict:
    (doc,) = [d for f in sorted(K8S.glob("*.yaml")) for d in documents(f.name) if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("name", sorted(p.name for p in K8S.glob("*.yaml")))
def test_manifests_match_the_kubernetes_schemas(name):
    """Every object is valid for its kind and API version (strict: no unknown field)."""
    import kubernetes_validate

    for doc in documents(name):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_manifests_agree_with_each_other_and_the_image():
    deployment, service, hpa = by_kind("Deployment"), by_kind("Service"), by_kind("HorizontalPodAutoscaler")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert f"WOQ_PORT={port}" in (ROOT / "Dockerfile").read_text()  # the port the image serves on
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # the grace period outlasts the preStop pause and the drain
    env = {e["name"]: e["value"] for e in container["env"]}
    pause = int(re.search(r"sleep (\d+)", " ".join(container["lifecycle"]["preStop"]["exec"]["command"]))[1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pause + float(env["WOQ_DRAIN_TIMEOUT"])
    # every WOQ_ variable is a setting the server reads (pydantic-settings: WOQ_ + the field)
    from woq.service.config import ServeSettings

    assert {k.removeprefix("WOQ_").lower() for k in env if k.startswith("WOQ_")} <= set(ServeSettings.model_fields)
    # a GPU a tensor-parallel rank, and /dev/shm in memory for NCCL between them
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(env["WOQ_TENSOR_PARALLEL_SIZE"])
    (shm,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert {v["name"]: v for v in pod["spec"]["volumes"]}[shm]["emptyDir"]["medium"] == "Memory"
    # the adapter serves the metric the autoscaler asks for, under its own name
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    (rule,) = yaml.safe_load(by_kind("ConfigMap")["data"]["config.yaml"])["rules"]
    assert rule["seriesQuery"].startswith(metric + "{") and rule["name"]["as"] == metric
    assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])


def test_scrape_configuration_keeps_the_annotated_pods():
    """The Kubernetes scrape job's relabelling, applied as Prometheus applies it (anchored
    regexes on the ';'-joined source labels), to a pod of woq.yaml: kept, scraped at the
    annotated port and path, labelled with the namespace and pod the adapter's rule maps."""
    annotations = by_kind("Deployment")["spec"]["template"]["metadata"]["annotations"]
    (job,) = yaml.safe_load((K8S / "prometheus.yml").read_text())["scrape_configs"]
    labels = {"__address__": "10.1.2.3:9999", "__metrics_path__": "/metrics", "__meta_kubernetes_namespace": "prod",
              "__meta_kubernetes_pod_name": "woq-abc"}
    labels |= {"__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-zA-Z0-9_]", "_", k): v
               for k, v in annotations.items()}
    for rule in job["relabel_configs"]:
        value = ";".join(labels.get(s, "") for s in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if rule.get("action", "replace") == "keep":
            assert match, rule
        elif match:
            labels[rule["target_label"]] = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
    assert labels["__address__"] == f"10.1.2.3:{annotations['prometheus.io/port']}"
    assert labels["__metrics_path__"] == annotations["prometheus.io/path"]
    assert labels["namespace"] == "prod" and labels["pod"] == "woq-abc"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian's prometheus package)")
def test_compose_scrape_configuration_is_valid():
    out = subprocess.run(["promtool", "check", "config", str(ROOT / "docker" / "prometheus.replicas.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    compose = yaml.safe_load((ROOT / "docker" / "compose.replicas.yaml").read_text())
    targets = yaml.safe_load((ROOT / "docker" / "prometheus.replicas.yml").read_text())
    (job,) = targets["scrape_configs"]
    assert {t.split(":")[0] for t in job["static_configs"][0]["targets"]} == {"woq-a", "woq-b"} <= set(compose["services"])


@pytest.fixture(scope="module")
def replicas(smollm2_dir):
    servers = [LiveServer("--model", str(smollm2_dir), "--served-model-name", "smollm2", "--quant", "int4",
                          "--max-seq-len", "512", "--max-num-seqs", "4") for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def nginx(replicas, tmp_path_factory):
    """docker/nginx.conf, its upstreams pointed at the two live servers, on a free port."""
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")  # (sbin: not on a user's PATH)
    if nginx is None:
        pytest.skip("needs nginx (Debian's nginx-light package)")
    d = tmp_path_factory.mktemp("nginx")
    port = free_port()
    conf = (ROOT / "docker" / "nginx.conf").read_text()
    conf = conf.replace("woq-a:8000", f"127.0.0.1:{replicas[0].port}").replace("woq-b:8000",
                                                                             f"127.0.0.1:{replicas[1].port}")
    conf = conf.replace("listen 8000;", f"listen 127.0.0.1:{port};")
    # (the test's own paths: nginx's defaults are system directories)
    conf = conf.replace("http {", "http {\n" + "".join(f"  {k}_temp_path {d / k};\n" for k in
                                                       ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
                        + f"  access_log {d / 'access.log'};\n", 1)
    (d / "nginx.conf").write_text(conf)
    cmd = [nginx, "-p", str(d), "-c", str(d / "nginx.conf"), "-g", f"daemon off; pid {d / 'nginx.pid'}; "
           f"error_log {d / 'error.log'};"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


def _served(server: LiveServer) -> float:
    """Chat completions a server has answered (its own metrics)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return metric_value(text, "woq_requests_total", endpoint="/v1/chat/completions", status="200")


def _stream(url: str, body: dict, opened: threading.Event) -> None:
    """POST a streamed request; ``opened`` is set at its first chunk."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                opened.set()


STREAM = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to a thousand."}],
          "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}


def test_nginx_balances_by_open_requests(replicas, nginx):
    """While one long stream holds a replica, least_conn sends every other request to the
    other one."""
    for s in replicas:  # (the probes the manifests use)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    before = [_served(s) for s in replicas]
    opened = threading.Event()
    long = threading.Thread(target=_stream, args=(nginx, STREAM, opened))
    long.start()
    assert opened.wait(60)
    short = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for _ in range(4):  # one at a time: the long stream's replica always has one more open
        r = httpx.post(nginx + "/v1/chat/completions", json=short, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    long.join(120)
    served = [_served(s) - b for s, b in zip(replicas, before)]
    assert sorted(served) == [1, 4]  # the long stream on one replica, the four short ones on the other
