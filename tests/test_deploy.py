"""deploy/: the Kubernetes manifests, systemd units and image that install stagetrace, each checked by the real tool.

kubernetes-validate (its bundled schemas, no cluster), kubectl's kustomize, promtool, systemd-analyze and checkov;
the command lines are parsed by stagetrace's own CLI. The Debian tools come through conftest's ``component``
(installed with apt as root; a skip with the reason elsewhere, a failure under CI=true). checkov gets a virtual
environment of its own: every checkov 3 pins networkx<2.7, and the test extra's llama-index-core needs networkx>=3.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv
from referencing import Registry, Resource

from stagetrace import cli, config, httpd

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
UNITS = {path.name: path for path in sorted((DEPLOY / "systemd").glob("*.service"))}
PAGE = (DEPLOY / "README.md").read_text()
# Custom resources of the Prometheus Operator: kubernetes-validate has no schema for them (checked below otherwise).
CUSTOM = {"ServiceMonitor", "PrometheusRule"}
META = "io.k8s.apimachinery.pkg.apis.meta.v1"  # the bundled definitions of ObjectMeta, LabelSelector
CHECKOV = "checkov>=3.2,<4"
# Each checkov skip is an annotation beside the setting it excuses, with its reason; the Deploy page names them.
CHECKOV_SKIPS = {"CKV_K8S_17", "CKV_K8S_19", "CKV_K8S_23", "CKV_K8S_40", "CKV2_K8S_6", "CKV_K8S_43"}


def _generator():
    spec = importlib.util.spec_from_file_location("deploy_generate", DEPLOY / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _objects() -> list[dict]:
    """Every Kubernetes object under deploy/kubernetes (the Kustomization is kustomize's, not the API's)."""
    return [
        doc
        for path in sorted(KUBERNETES.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _one(kind: str, name: str) -> dict:
    (found,) = [o for o in _objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def _pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def test_the_generated_manifests_are_what_the_generator_writes(tmp_path, monkeypatch):
    generate = _generator()
    for path, text in generate.build().items():
        assert path.read_text() == text, f"{path} is stale: run python deploy/generate.py"
    monkeypatch.setattr(generate, "KUBERNETES", tmp_path)  # its writes and checks, away from the committed files
    assert generate.main(["--check"]) == 1
    assert generate.main([]) == 0
    assert generate.main(["--check"]) == 0


def _definition(version: str, name: str, instance) -> None:
    """Validate ``instance`` against one definition of kubernetes-validate's bundled (strict) schema."""
    definitions = kv.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    schema = {"$schema": definitions["$schema"], "$ref": f"{definitions['$id']}#/$defs/{name}"}
    registry = Resource.from_contents(definitions) @ Registry()
    jsonschema.Draft202012Validator(schema, registry=registry).validate(instance)


def test_every_object_validates_against_the_kubernetes_schema():
    versions = sorted(set(kv.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    objects = _objects()
    for version in (versions[0], versions[-1]):  # the oldest and the newest release it bundles
        for obj in objects:
            where = f"{obj['kind']}/{obj['metadata']['name']} against Kubernetes {version}"
            try:
                if obj["kind"] in CUSTOM:  # the parts that are Kubernetes' own types
                    _definition(version, f"{META}.ObjectMeta", obj["metadata"])
                    if obj["kind"] == "ServiceMonitor":
                        _definition(version, f"{META}.LabelSelector", obj["spec"]["selector"])
                else:
                    kubernetes_validate.validate(obj, version, strict=True)
            except jsonschema.ValidationError as exc:
                pytest.fail(f"{where}: {'.'.join(map(str, exc.absolute_path))}: {exc.message}")
    kinds = {o["kind"] for o in objects}
    assert {
        "Namespace",
        "DaemonSet",
        "Deployment",
        "Service",
        "ServiceMonitor",
        "PrometheusRule",
        "ConfigMap",
        "NetworkPolicy",
    } <= kinds
    assert all(o["metadata"].get("namespace") == "stagetrace" for o in objects if o["kind"] != "Namespace")


def test_each_service_monitor_scrapes_a_port_its_service_and_pods_have():
    objects = _objects()
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"stagetrace-agent", "stagetrace-analyser"}
    for monitor in monitors:
        (service,) = [
            o
            for o in objects
            if o["kind"] == "Service" and _matches(monitor["spec"]["selector"]["matchLabels"], o["metadata"]["labels"])
        ]
        (workload,) = [
            o
            for o in objects
            if o["kind"] in ("DaemonSet", "Deployment") and _matches(service["spec"]["selector"], _pod_labels(o))
        ]
        container = _container(workload)
        container_ports = {p["name"] for p in container["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
        assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, probe


def test_the_kustomization_lists_and_builds_every_manifest(component):
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    kubectl = component("kubectl", "kubernetes-client")
    built = subprocess.run([kubectl, "kustomize", str(KUBERNETES)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    names = sorted((o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(built.stdout) if o)
    assert names == sorted((o["kind"], o["metadata"]["name"]) for o in _objects())


def test_the_prometheus_rule_is_the_rules_file_and_passes_promtool(component, tmp_path):
    rules = ROOT / "dashboards" / "prometheus" / "hardware.rules.yml"
    spec = _one("PrometheusRule", "stagetrace-hardware")["spec"]
    assert spec == yaml.safe_load(rules.read_text())
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    promtool = component("promtool", "prometheus")
    checked = subprocess.run([promtool, "check", "rules", tmp_path / "rules.yml"], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in spec['groups'])} rules found" in checked.stdout


def test_the_dashboard_config_maps_hold_exactly_the_generated_dashboards():
    maps = [
        o for o in _objects() if o["kind"] == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    held = {name: text.encode() for m in maps for name, text in m["data"].items()}
    assert held == {p.name: p.read_bytes() for p in (ROOT / "dashboards" / "generated").glob("*.json")}
    assert all(len(m["data"]) == 1 for m in maps)  # one dashboard each: the reason is in deploy/generate.py


def _command_lines() -> dict[str, list[str]]:
    """Every stagetrace command line deploy/ runs, as argv after `stagetrace`, with Kubernetes' $(POD_IP) filled."""
    lines = {}
    for kind, name in (("DaemonSet", "stagetrace-agent"), ("Deployment", "stagetrace-analyser")):
        lines[f"{kind} {name}"] = [a.replace("$(POD_IP)", "10.0.0.7") for a in _container(_one(kind, name))["args"]]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (entrypoint,) = re.findall(r"^ENTRYPOINT (.+)$", dockerfile, re.M)
    assert json.loads(entrypoint) == ["stagetrace"]  # so the manifests' args are stagetrace's
    (command,) = re.findall(r"^CMD (.+)$", dockerfile, re.M)
    lines["Dockerfile CMD"] = json.loads(command)
    for name, path in UNITS.items():
        (start,) = re.findall(r"^ExecStart=(.+)$", path.read_text(), re.M)
        binary, *argv = shlex.split(start)
        assert binary == "/usr/local/bin/stagetrace"
        lines[name] = argv
    return lines


def test_every_command_line_parses_with_the_cli():
    parser = cli.build_parser()
    for where, argv in _command_lines().items():
        args = parser.parse_args(argv)  # an unknown flag exits here, naming it
        for flag in ("listen", "otlp", "otlp_grpc", "query_listen"):
            value = getattr(args, flag, None)
            if value and value.lower() not in ("none", "off"):
                httpd.parse_listen(value)  # ValueError names the address
        assert args.command in ("agent", "analyse"), where


def test_every_setting_named_in_deploy_is_one_the_code_reads():
    code = "".join(
        p.read_text()
        for folder in ("src/stagetrace", "collectors", "exporters", "dashboards")
        for p in (ROOT / folder).rglob("*.py")
    )
    named = set()
    for path in [*KUBERNETES.glob("*.yaml"), *UNITS.values(), DEPLOY / "Dockerfile"]:
        named |= set(re.findall(r"\b(STAGETRACE_\w+|CUDA_MPS_PIPE_DIRECTORY|XDG_STATE_HOME)\b", path.read_text()))
    assert "STAGETRACE_STORE" in named
    assert {name for name in named if f'"{name}"' not in code} == set()


def test_the_agents_listeners_off_loopback_have_a_token_the_agent_accepts(tmp_path):
    """The agent refuses a query endpoint off loopback without a token, and serves OTLP off loopback without one
    only with a warning: where deploy/ opens them, it gives the token, in a file mode the agent accepts."""
    daemonset = _one("DaemonSet", "stagetrace-agent")
    container = _container(daemonset)
    env = {e["name"]: e.get("value") for e in container["env"]}
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    parser = cli.build_parser()
    for where, argv in _command_lines().items():
        args = parser.parse_args(argv)
        if args.command != "agent":
            continue
        guarded = [getattr(args, flag) for flag in ("otlp", "otlp_grpc", "query_listen")]
        exposed = [
            a for a in guarded if a.lower() not in ("none", "off") and not httpd.is_loopback(httpd.parse_listen(a)[0])
        ]
        if not exposed:
            continue
        assert where == "DaemonSet stagetrace-agent", f"{where} opens {exposed} without a token"
        token = Path(env[config.ENV_TOKEN_FILE])
        (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == token.parent]
        secret = volumes[mount["name"]]["secret"]
        assert mount["readOnly"] and [i["path"] for i in secret["items"]] == [token.name]
        copy = tmp_path / token.name
        copy.write_text("a-token\n")
        copy.chmod(secret["defaultMode"])
        assert config.load_token(copy) == "a-token"  # TokenError for a mode others can read


def _host_volumes(workload: dict) -> dict[str, tuple[str, bool]]:
    spec = workload["spec"]["template"]["spec"]
    paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = _container(workload)["volumeMounts"]
    return {paths[m["name"]]: m.get("readOnly", False) for m in mounts if m["name"] in paths}


def test_the_agent_pod_is_confined_as_the_issue_asks():
    daemonset = _one("DaemonSet", "stagetrace-agent")
    spec = daemonset["spec"]["template"]["spec"]
    context = _container(daemonset)["securityContext"]
    assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"] and not context["privileged"]
    assert context["capabilities"] == {"drop": ["ALL"]}  # nothing added: the reasons are beside it
    assert spec["runtimeClassName"] == "nvidia" and spec["nodeSelector"] and spec["tolerations"]
    # the host's files it reads are read-only; the one it writes is the spool's
    assert _host_volumes(daemonset) == {
        "/sys": True,
        "/var/lib/kubelet/pod-resources": True,
        "/run/nvidia/mps": True,
        "/var/log/pods": True,
        "/var/log/containers": True,
        "/var/lib/stagetrace": False,
    }
    assert spec["hostPID"] and spec["hostNetwork"]  # the GPU tenants' PIDs, the NICs' ioctls: reasons beside them
    analyser = _one("Deployment", "stagetrace-analyser")
    assert analyser["spec"]["replicas"] == 1 and analyser["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]


def _directives(path: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


def test_the_units_are_hardened_and_write_only_the_store():
    assert set(UNITS) == {"stagetrace-agent.service", "stagetrace-analyser.service"}
    for name, path in UNITS.items():
        unit = _directives(path)
        for key, value in {
            "ProtectSystem": "strict",
            "NoNewPrivileges": "yes",
            "PrivateTmp": "yes",
            "CapabilityBoundingSet": "",
            "AmbientCapabilities": "",
        }.items():
            assert unit.get(key) == [value], f"{name}: {key}"
        assert "ReadWritePaths" not in unit, name
    agent, analyser = _directives(UNITS["stagetrace-agent.service"]), _directives(UNITS["stagetrace-analyser.service"])
    assert agent["StateDirectory"] == ["stagetrace"]  # /var/lib/stagetrace: its store and the spool beside it
    assert agent["Environment"] == ["STAGETRACE_STORE=chdb:///var/lib/stagetrace/store"]
    assert "StateDirectory" not in analyser  # its store is the server: nothing to write here


def test_systemd_analyze_verify_passes_the_units(component, tmp_path):
    """verify checks that ExecStart's binary exists, in the root it is given: a root with the host's unit
    directory (for the targets the units order against) and a stand-in at /usr/local/bin/stagetrace."""
    analyze = component("systemd-analyze", "systemd")
    (tmp_path / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", tmp_path / "usr/lib/systemd/system", symlinks=True)
    (tmp_path / "etc/systemd/system").mkdir(parents=True)
    for path in UNITS.values():
        shutil.copy(path, tmp_path / "etc/systemd/system")
    binary = tmp_path / "usr/local/bin/stagetrace"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    verified = subprocess.run([analyze, "verify", f"--root={tmp_path}", *UNITS], capture_output=True, text=True)
    # verify exits 0 on an unknown or unparsable setting, which it only warns about: any word from it fails
    assert (verified.returncode, verified.stdout + verified.stderr) == (0, "")


def test_the_deploy_page_gives_systemd_analyze_securitys_exposure_figures(component):
    analyze = component("systemd-analyze", "systemd")
    for name, path in UNITS.items():
        rated = subprocess.run([analyze, "security", "--offline=true", path], capture_output=True, text=True)
        assert rated.returncode == 0, rated.stderr
        (figure,) = re.findall(rf"Overall exposure level for {re.escape(name)}: \d+\.\d+ \w+", rated.stdout)
        assert figure in PAGE, f"deploy/README.md should say: {figure}"


@pytest.fixture(scope="session")
def checkov() -> Path:
    """checkov in a virtual environment of its own (the module docstring says why), kept between runs."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stagetrace-tests" / "checkov-3"
    binary = home / "bin" / "checkov"
    if not binary.exists():
        try:
            subprocess.run([sys.executable, "-m", "venv", "--clear", home], check=True, capture_output=True)
            subprocess.run(
                [home / "bin" / "python", "-m", "pip", "install", "-q", CHECKOV],
                check=True,
                capture_output=True,
                timeout=900,
            )
        except (subprocess.SubprocessError, OSError) as exc:
            shutil.rmtree(home, ignore_errors=True)
            message = f"checkov ({CHECKOV}) could not be installed: {getattr(exc, 'stderr', b'') or exc}"
            if os.environ.get("CI") == "true":
                pytest.fail(message)
            pytest.skip(message)
    return binary


def test_checkov_finds_nothing_to_fix_in_deploy(checkov):
    command = [
        checkov,
        "--directory",
        DEPLOY,
        "--framework",
        "kubernetes",
        "dockerfile",
        "secrets",
        "--skip-download",
        "--output",
        "json",
    ]
    scanned = subprocess.run(command, capture_output=True, text=True, timeout=600)
    reports = json.loads(scanned.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    by_type = {r["check_type"]: r for r in reports}
    assert {"kubernetes", "dockerfile"} <= set(by_type), scanned.stderr
    for kind, report in by_type.items():
        failed = [(c["check_id"], c["resource"], c["file_path"]) for c in report["results"]["failed_checks"]]
        assert (failed, report["summary"]["parsing_errors"]) == ([], 0), kind
    skipped = [c for r in reports for c in r["results"]["skipped_checks"]]
    assert all(c.get("check_result", {}).get("suppress_comment") for c in skipped)  # each with its reason
    assert {c["check_id"] for c in skipped} == CHECKOV_SKIPS
    assert all(check in PAGE for check in CHECKOV_SKIPS)


def test_the_image_holds_every_folder_the_package_is_built_from():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    copied = {source for line in re.findall(r"^COPY (?!--)(.+)$", dockerfile, re.M) for source in line.split()[:-1]}
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {d.split("/")[0] for d in package_dirs.values()} | {"pyproject.toml", "README.md"} <= copied
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert all(f"!{source}" in ignore for source in copied)  # the context excludes everything else
    assert re.search(r"^USER 10001", dockerfile, re.M) and 'VOLUME ["/var/lib/stagetrace"]' in dockerfile
