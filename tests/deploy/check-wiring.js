#!/usr/bin/env node
// tests/deploy/check-wiring.js — checks that the pieces of a rendered chart line up, as the
// services in the pods will see them.
//
//   node check-wiring.js --deps DIR --bin BIN_DIR [--external-secret NAME]...
//                        [--expect-backend B --expect-gpus N] RENDER.yaml
//
// For every service pod template (controller, lifecycle, worker, gateway; StatefulSet, Deployment and
// LeaderWorkerSet alike) the ConfigMap key its `--config` path names is loaded by the real binary
// (BIN_DIR/pie-<svc> --print-config), with the PIE_* variables the pod sets ($(VAR) references
// expanded with stand-in pod names), so every check below is about the effective configuration
// the process runs with, binary defaults included. Then:
//
//  backend   a worker pod that requests a GPU (a `*/gpu` resource) runs backend cuda, and a worker
//            pod that runs cuda requests one (a pod without GPUs runs cpu or null); with
//            --expect-backend/--expect-gpus, every worker pod runs exactly that backend with that
//            many GPUs.
//  ports     server.listen and metrics.listen are the container's grpc and metrics ports; the
//            gRPC probes target server.listen with the health names the binaries serve
//            (readiness on pie.v1.<Service>, startup and liveness on ""); the Prometheus
//            annotation names metrics.listen; every Service port reaches the port of the same
//            role in every pod it selects; controller.address, worker.advertise,
//            replica.advertise, PIE_TP_LEADER and the addresses of the `helm test` pod name a
//            rendered Service (or a pod's stable DNS name) in the release namespace and reach the
//            gRPC port of the pods behind it; every address uses the same cluster domain.
//  gateway   http.listen is the container's "http" port and the Service's "http" port reaches
//            it; readiness is GET /readyz on that port (startup and liveness: gRPC "" on
//            server.listen, or GET /healthz); lifecycle.address is dns:/// + the lifecycle's
//            headless Service and reaches the lifecycle pods' gRPC port; the gateway test pod's
//            GATEWAY_URL reaches http.listen and its MODEL is the workers' model.name.
//  secrets   auth.token_file is a file of a mounted Secret volume, that Secret is rendered (or
//            --external-secret) and holds the key, the file is readable by the pod's user, and
//            every service and the test pods use the same Secret key (or auth is off everywhere);
//            the gateway holds no token (it forwards each client's key).
//  disk      a lifecycle pod whose runtime.cache_dir is an emptyDir with a sizeLimit bounds what it
//            writes there below that limit (the kubelet evicts a pod past it, with every
//            running instance): programs.store_size and runtime.cache_size are set (non-zero)
//            and together at most 3/4 of the limit, the rest left for fetched tokenizers,
//            compiles in progress and the loaded programs' native code beyond its bound.
//  drain     lifecycle and worker containers have a preStop hook ["sleep", N], and the pod's
//            terminationGracePeriodSeconds >= N + server.shutdown_grace + 5 s, so that Kubernetes
//            does not kill a pod whose instances are still finishing.
// Exit status 1 with one line per problem, naming the object, the pod template and the value.
'use strict';

const fs = require('fs');
const os = require('os');
const path = require('path');
const Module = require('module');
const { execFileSync } = require('child_process');

const argv = process.argv.slice(2);
let deps = null, bin = null, expectBackend = null, expectGpus = null;
const externalSecrets = new Set();
const files = [];
for (let i = 0; i < argv.length; i++) {
  if (argv[i] === '--deps') deps = argv[++i];
  else if (argv[i] === '--bin') bin = argv[++i];
  else if (argv[i] === '--external-secret') externalSecrets.add(argv[++i]);
  else if (argv[i] === '--expect-backend') expectBackend = argv[++i];
  else if (argv[i] === '--expect-gpus') expectGpus = Number(argv[++i]);
  else files.push(argv[i]);
}
if (!deps || !bin || files.length !== 1) {
  console.error('usage: check-wiring.js --deps DIR --bin BIN_DIR [--external-secret NAME]... '
    + '[--expect-backend B --expect-gpus N] RENDER.yaml');
  process.exit(2);
}
const req = Module.createRequire(path.join(path.resolve(deps), 'noop.js'));
const yaml = req('js-yaml');

const SERVICES = ['controller', 'lifecycle', 'worker', 'gateway'];
// Components that dial the controller (controller.address).
const DIALS_CONTROLLER = ['lifecycle', 'worker'];
// Components that drain on SIGTERM (running instances finish) and the seconds Kubernetes must
// give them on top of preStop + server.shutdown_grace (the stop itself).
const DRAINS = ['lifecycle', 'worker'];
const DRAIN_MARGIN_S = 5;
// The gateway's HTTP endpoints each probe may use (services/gateway/gw_http.h).
const GATEWAY_HTTP_PROBES = { startupProbe: ['/healthz'], readinessProbe: ['/readyz'], livenessProbe: ['/healthz'] };
// The health names the binaries register (svc_add_health in services/*/…_main.c).
const READY_HEALTH = { controller: 'pie.v1.Controller', lifecycle: 'pie.v1.Lifecycle', worker: 'pie.v1.Worker' };
// Stand-ins for the downward-API variables, so $(VAR) references expand as in a running pod.
const GROUP_INDEX = "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']";
const WORKER_INDEX = "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']";
const FIELD_STANDINS = {
  'metadata.name': 'podname-0',
  'status.podIP': '10.1.2.3',
  [GROUP_INDEX]: '0',
  [WORKER_INDEX]: '0',
};
// A LeaderWorkerSet's workerTemplate makes the pods after the leader: worker index 1 stands in.
const RANK_STANDINS = { ...FIELD_STANDINS, [WORKER_INDEX]: '1' };

const renderText = fs.readFileSync(files[0], 'utf8');
const docs = yaml.loadAll(renderText).filter((d) => d && typeof d === 'object');
// A Secret the render itself names for the operator to create (helm/pie/templates/secret.yaml
// on an offline render) counts as --external-secret.
for (const m of renderText.matchAll(/^# pie: external Secret (\S+) /gm)) externalSecrets.add(m[1]);
const byKind = (kind, name) => docs.find((d) => d.kind === kind && d.metadata && d.metadata.name === name);
const subset = (sel, labels) => Object.entries(sel || {}).every(([k, v]) => labels && labels[k] === v);
const errors = [];
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'pie-wiring-'));

// ---- pods -------------------------------------------------------------------------------------

function podTemplates(d) {
  const s = d.spec || {};
  const id = `${d.kind}/${d.metadata.name}`;
  switch (d.kind) {
    case 'Deployment': case 'StatefulSet': return [{ id: `${id} spec.template`, t: s.template, owner: d }];
    case 'LeaderWorkerSet': {
      const lwt = s.leaderWorkerTemplate || {};
      const out = [{ id: `${id} workerTemplate`, t: lwt.workerTemplate, owner: d, standins: RANK_STANDINS }];
      if (lwt.leaderTemplate) out.push({ id: `${id} leaderTemplate`, t: lwt.leaderTemplate, owner: d });
      return out;
    }
    case 'Pod': return [{ id, t: { metadata: d.metadata, spec: d.spec }, owner: d }];
    default: return [];
  }
}

// Literal env of a container with $(VAR) expanded (valueFrom fieldRef: stand-ins).
function expandedEnv(c, standins = FIELD_STANDINS) {
  const env = {};
  for (const e of c.env || []) {
    if (e.value !== undefined) {
      env[e.name] = String(e.value).replace(/(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g,
        (m, v) => (v in env ? env[v] : m));
    } else if (e.valueFrom && e.valueFrom.fieldRef) {
      env[e.name] = standins[e.valueFrom.fieldRef.fieldPath] || 'x';
    }
  }
  return env;
}

function parseAddress(addr) { // "host:port" or "dns:///host:port" -> {host, port}
  const m = /^(?:dns:\/\/\/)?([^:/]+):([0-9]+)$/.exec(String(addr || ''));
  return m ? { host: m[1], port: Number(m[2]) } : null;
}

// The pods (component label, template, containers) and their effective configuration.
const pods = [];
for (const d of docs) {
  for (const { id, t, owner, standins } of podTemplates(d)) {
    const labels = (t.metadata || {}).labels || {};
    const spec = t.spec || {};
    const pod = { id, owner, labels, spec, standins: standins || FIELD_STANDINS, annotations: (t.metadata || {}).annotations || {},
      component: labels['app.kubernetes.io/component'], ports: {}, containers: spec.containers || [] };
    for (const c of pod.containers) for (const p of c.ports || []) if (p.name) pod.ports[p.name] = p.containerPort;
    if (SERVICES.includes(pod.component)) pod.svc = serviceContainer(pod);
    pods.push(pod);
  }
}

// The container running pie-<component>, its config file and effective configuration.
function serviceContainer(pod) {
  const c = pod.containers.find((x) => String((x.command || [])[0]).endsWith(`/pie-${pod.component}`));
  if (!c) { errors.push(`${pod.id}: no container runs pie-${pod.component}`); return null; }
  const cmd = [...(c.command || []), ...(c.args || [])];
  const i = cmd.indexOf('--config');
  if (i < 0) { errors.push(`${pod.id}: pie-${pod.component} has no --config`); return null; }
  const file = cmd[i + 1];
  const mount = (c.volumeMounts || []).find((m) => m.mountPath === path.posix.dirname(file));
  const vol = mount && (pod.spec.volumes || []).find((v) => v.name === mount.name);
  const cm = vol && vol.configMap && byKind('ConfigMap', vol.configMap.name);
  const key = path.posix.basename(file);
  if (!cm || !(cm.data || {})[key]) {
    errors.push(`${pod.id}: --config ${file} is not a key of a ConfigMap mounted at ${path.posix.dirname(file)}`);
    return null;
  }
  const env = expandedEnv(c, pod.standins);
  const cfgFile = path.join(tmp, `${pod.component}-${pods.length}.yaml`);
  fs.writeFileSync(cfgFile, cm.data[key]);
  const pieEnv = Object.fromEntries(Object.entries(env).filter(([k]) => k.startsWith('PIE_')));
  let out;
  try {
    out = execFileSync(path.join(bin, `pie-${pod.component}`), ['--config', cfgFile, '--print-config'],
      { env: { PATH: process.env.PATH, ...pieEnv }, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
  } catch (e) {
    errors.push(`${pod.id}: pie-${pod.component} rejects ConfigMap ${cm.metadata.name} key ${key} with the pod's PIE_* variables: ${String(e.stderr).trim()}`);
    return null;
  }
  return { container: c, env, cfg: yaml.load(out), configMap: cm.metadata.name, key };
}

const svcPods = pods.filter((p) => p.svc);
const listenPort = (pod, key) => {
  const a = parseAddress(((pod.svc.cfg || {})[key] || {}).listen);
  return a ? a.port : null;
};

// ---- backend ----------------------------------------------------------------------------------

function gpusRequested(c) {
  const r = c.resources || {};
  let n = 0;
  for (const part of [r.limits || {}, r.requests || {}]) {
    for (const [k, v] of Object.entries(part)) if (/\/gpu$/.test(k)) n = Math.max(n, Number(v));
  }
  return n;
}

for (const pod of svcPods.filter((p) => p.component === 'worker')) {
  const backend = String(pod.svc.cfg.backend); // YAML reads the null backend's name as null
  const gpus = gpusRequested(pod.svc.container);
  const where = `${pod.id}: ConfigMap ${pod.svc.configMap} (${pod.svc.key})`;
  if (gpus > 0 && backend !== 'cuda') errors.push(`${where}: the pod requests ${gpus} GPU(s) but pie-worker runs backend ${backend} (--print-config), not cuda`);
  if (gpus === 0 && backend === 'cuda') errors.push(`${where}: pie-worker runs backend cuda but the pod requests no GPU`);
  if (expectBackend !== null && backend !== expectBackend) errors.push(`${where}: backend ${backend}, expected ${expectBackend}`);
  if (expectGpus !== null && gpus !== expectGpus) errors.push(`${pod.id}: requests ${gpus} GPU(s), expected ${expectGpus}`);
}
if (expectBackend !== null && !svcPods.some((p) => p.component === 'worker')) errors.push('no worker pod template rendered');

// ---- ports and probes -------------------------------------------------------------------------

for (const pod of svcPods) {
  const grpc = listenPort(pod, 'server');
  const metrics = listenPort(pod, 'metrics');
  const c = pod.svc.container;
  if (grpc === null) errors.push(`${pod.id}: server.listen "${pod.svc.cfg.server.listen}" has no port`);
  else if (pod.ports.grpc !== grpc) errors.push(`${pod.id}: server.listen port ${grpc} is not the container port "grpc" (${pod.ports.grpc})`);
  if (metrics === null) errors.push(`${pod.id}: metrics.listen "${(pod.svc.cfg.metrics || {}).listen}" has no port (metrics off, but the pod declares a metrics port)`);
  else if (pod.ports.metrics !== metrics) errors.push(`${pod.id}: metrics.listen port ${metrics} is not the container port "metrics" (${pod.ports.metrics})`);
  if (pod.component === 'gateway') {
    const http = listenPort(pod, 'http');
    if (http === null) errors.push(`${pod.id}: http.listen "${(pod.svc.cfg.http || {}).listen}" has no port`);
    else if (pod.ports.http !== http) errors.push(`${pod.id}: http.listen port ${http} is not the container port "http" (${pod.ports.http})`);
  }
  for (const probe of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
    const hg = (c[probe] || {}).httpGet;
    if (hg && pod.component === 'gateway') {
      const port = typeof hg.port === 'number' ? hg.port : pod.ports[hg.port];
      const http = listenPort(pod, 'http');
      if (port !== http) errors.push(`${pod.id}: ${probe} GETs port ${hg.port} (${port}), but pie-gateway serves HTTP on ${http}`);
      if (!GATEWAY_HTTP_PROBES[probe].includes(hg.path)) errors.push(`${pod.id}: ${probe} GETs ${hg.path}, pie-gateway answers it on ${GATEWAY_HTTP_PROBES[probe].join(' or ')}`);
      continue;
    }
    if (pod.component === 'gateway' && probe === 'readinessProbe') { errors.push(`${pod.id}: readinessProbe is not GET /readyz (the gateway is ready while a lifecycle replica serves)`); continue; }
    let g = (c[probe] || {}).grpc;
    const ex = ((c[probe] || {}).exec || {}).command;
    if (!g && ex && ex[0] === '/usr/local/bin/piectl' && ex[ex.length - 1] === 'health') {
      // TLS: piectl --tls-ca <ca> --addr localhost:<port> --service <name> health
      const opt = (name) => { const i = ex.indexOf(name); return i > 0 ? ex[i + 1] : undefined; };
      const m = /^localhost:(\d+)$/.exec(opt('--addr') || '');
      const caFile = (pod.svc.cfg.tls || {}).ca_file;
      if (!caFile || opt('--tls-ca') !== caFile) errors.push(`${pod.id}: ${probe} runs piectl with --tls-ca ${opt('--tls-ca')}, but tls.ca_file is ${caFile}`);
      g = { port: m ? Number(m[1]) : null, service: opt('--service') };
    }
    if (!g) { errors.push(`${pod.id}: ${probe} is not a gRPC probe`); continue; }
    if (g.port !== grpc) errors.push(`${pod.id}: ${probe} probes port ${g.port}, but pie-${pod.component} listens on ${grpc}`);
    const want = probe === 'readinessProbe' ? READY_HEALTH[pod.component] : '';
    if ((g.service || '') !== want) errors.push(`${pod.id}: ${probe} asks for health of "${g.service || ''}", pie-${pod.component} serves "${want}" for it`);
  }
  const ann = pod.annotations['prometheus.io/port'];
  if (ann !== undefined && Number(ann) !== metrics) errors.push(`${pod.id}: annotation prometheus.io/port ${ann} is not metrics.listen port ${metrics}`);
}

// A Service port reaches, in every pod the Service selects, the container port of the same name.
function targetOf(svcPort, pod) {
  const t = svcPort.targetPort === undefined ? svcPort.port : svcPort.targetPort;
  if (typeof t === 'number') return Object.values(pod.ports).includes(t) ? t : null;
  return pod.ports[t] === undefined ? null : pod.ports[t];
}
for (const s of docs.filter((d) => d.kind === 'Service')) {
  const selected = pods.filter((p) => subset(s.spec.selector, p.labels));
  for (const sp of s.spec.ports || []) {
    for (const pod of selected) {
      const got = targetOf(sp, pod);
      if (got === null) errors.push(`Service/${s.metadata.name} port ${sp.name} (${sp.port}): targetPort ${sp.targetPort} is not a port of ${pod.id}`);
      else if (pod.svc && ['grpc', 'metrics', 'http'].includes(sp.name)) {
        const want = listenPort(pod, { grpc: 'server', metrics: 'metrics', http: 'http' }[sp.name]);
        if (got !== want) errors.push(`Service/${s.metadata.name} port ${sp.name} reaches ${got} in ${pod.id}, where pie-${pod.component} listens on ${want}`);
      }
    }
  }
}

// ---- addresses --------------------------------------------------------------------------------

const domains = new Set();
// Resolves host:port to the pods behind it and checks that it reaches their gRPC server.
// host: <service>.<namespace>.svc.<domain>, or <pod>.<headless service>.… when podName is given.
function checkAddress(where, addr, component, opts = {}) {
  const a = parseAddress(addr);
  if (!a) { errors.push(`${where}: "${addr}" is not host:port`); return; }
  let host = a.host;
  if (opts.podPrefix !== undefined) {
    if (!host.startsWith(`${opts.podPrefix}.`)) { errors.push(`${where}: "${addr}" does not start with the pod's name ${opts.podPrefix}`); return; }
    host = host.slice(opts.podPrefix.length + 1);
  }
  const m = /^([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.(.+)$/.exec(host);
  if (!m) { errors.push(`${where}: "${addr}" is not <service>.<namespace>.svc.<cluster domain>:<port>`); return; }
  const [, name, ns, domain] = m;
  domains.add(domain);
  let targets;
  if (opts.lwsName !== undefined) {
    // The LeaderWorkerSet controller's headless Service, named after the LeaderWorkerSet,
    // selects the pods of the set; a pod's own port is dialed directly.
    if (name !== opts.lwsName) { errors.push(`${where}: "${addr}": pods of LeaderWorkerSet ${opts.lwsName} are named under ${opts.lwsName}, not ${name}`); return; }
    targets = opts.pods.map((p) => (p.svc ? listenPort(p, 'server') : p.ports.grpc));
    if (ns !== opts.owner.metadata.namespace) errors.push(`${where}: "${addr}": namespace ${ns}, the pods are in ${opts.owner.metadata.namespace}`);
  } else {
    const s = byKind('Service', name);
    if (!s) { errors.push(`${where}: "${addr}": no Service ${name} is rendered`); return; }
    if (ns !== s.metadata.namespace) errors.push(`${where}: "${addr}": Service ${name} is in namespace ${s.metadata.namespace}, not ${ns}`);
    if (opts.podPrefix !== undefined && s.spec.clusterIP !== 'None') errors.push(`${where}: "${addr}": pod DNS names need a headless Service, ${name} is not`);
    const behind = pods.filter((p) => subset(s.spec.selector, p.labels));
    if (!behind.length || behind.some((p) => p.component !== component)) {
      errors.push(`${where}: "${addr}": Service ${name} does not select the ${component} pods`); return;
    }
    if (opts.podPrefix !== undefined) {
      // Pod DNS: the port is the pod's own.
      targets = behind.map((p) => (p.svc ? listenPort(p, 'server') : p.ports.grpc));
    } else {
      const sp = (s.spec.ports || []).find((p) => p.port === a.port);
      if (!sp) { errors.push(`${where}: "${addr}": Service ${name} has no port ${a.port}`); return; }
      targets = behind.map((p) => targetOf(sp, p));
      a.port = null;
    }
    for (const [i, p] of behind.entries()) {
      const want = p.svc ? listenPort(p, 'server') : p.ports.grpc;
      const got = a.port === null ? targets[i] : a.port;
      if (got !== want) errors.push(`${where}: "${addr}" reaches port ${got} of ${p.id}, where pie-${component} listens on ${want}`);
    }
    return;
  }
  for (const want of targets) if (a.port !== want) errors.push(`${where}: "${addr}" port ${a.port} is not the gRPC port ${want} of the ${component} pods`);
}

for (const pod of svcPods) {
  const cfg = pod.svc.cfg;
  const podName = FIELD_STANDINS['metadata.name'];
  if (DIALS_CONTROLLER.includes(pod.component)) checkAddress(`${pod.id}: controller.address`, cfg.controller.address, 'controller');
  if (pod.component === 'gateway') {
    // One gRPC channel over every lifecycle pod: the dns resolver on a headless Service.
    const addr = String((cfg.lifecycle || {}).address);
    const a = parseAddress(addr);
    const s = a && byKind('Service', a.host.split('.')[0]);
    if (!addr.startsWith('dns:///')) errors.push(`${pod.id}: lifecycle.address "${addr}" is not dns:///<lifecycle headless Service>:<port> (the gateway would not spread requests over the lifecycle pods)`);
    else if (s && s.spec.clusterIP !== 'None') errors.push(`${pod.id}: lifecycle.address "${addr}": Service ${s.metadata.name} is not headless (its one virtual IP pins the gateway's channel to one lifecycle pod)`);
    checkAddress(`${pod.id}: lifecycle.address`, addr, 'lifecycle');
  }
  if (pod.component === 'worker') {
    const isLws = pod.owner.kind === 'LeaderWorkerSet';
    const peers = pods.filter((p) => p.owner === pod.owner);
    if (isLws) checkAddress(`${pod.id}: worker.advertise`, cfg.worker.advertise, 'worker', { podPrefix: podName, lwsName: pod.owner.metadata.name, owner: pod.owner, pods: peers });
    else {
      if (!cfg.worker.advertise.includes(`.${pod.owner.spec.serviceName}.`)) errors.push(`${pod.id}: worker.advertise "${cfg.worker.advertise}" is not under the StatefulSet's serviceName ${pod.owner.spec.serviceName}`);
      checkAddress(`${pod.id}: worker.advertise`, cfg.worker.advertise, 'worker', { podPrefix: podName });
    }
    const tpSize = Number((cfg.tp || {}).size || 1);
    if (isLws && (tpSize > 1 || Number((pod.owner.spec.leaderWorkerTemplate || {}).size) > 1)) checkGroup(pod, peers);
    else if ((cfg.tp || {}).leader || Number((cfg.tp || {}).rank) >= 0) errors.push(`${pod.id}: tp.rank ${cfg.tp.rank} / tp.leader "${cfg.tp.leader}" outside a group of pods (a launched group's ranks are forked)`);
  }
  if (pod.component === 'lifecycle') {
    const a = parseAddress(cfg.replica.advertise);
    if (!a || a.host !== FIELD_STANDINS['status.podIP'] || a.port !== listenPort(pod, 'server')) {
      errors.push(`${pod.id}: replica.advertise "${cfg.replica.advertise}" is not <pod IP>:${listenPort(pod, 'server')}`);
    }
  }
}
// A tensor-parallel group spanning the pods of a LeaderWorkerSet group, one rank each (worker
// pod `pod` of it; peers: the templates of the same LeaderWorkerSet). tp.size is the group's pod
// count; a pod's tp.rank is its worker index (the leader 0); every pod's tp.leader is the
// leader's gRPC server (Worker/TpJoin): <lws>-<group index>.<lws>.<namespace>.svc.<domain>:<its
// server.listen port>; the leader listens for the collective on tp.port, which its container
// declares as "tp"; LeaderReady would never start the group (the leader is ready once the others
// joined); a NetworkPolicy selecting the worker pods lets worker pods reach both ports.
function checkGroup(pod, peers) {
  const tp = pod.svc.cfg.tp || {}, name = pod.owner.metadata.name;
  const pods_ = Number((pod.owner.spec.leaderWorkerTemplate || {}).size);
  const role = pod.labels['pie-tp-role'];
  if (Number(tp.size) !== pods_) errors.push(`${pod.id}: tp.size ${tp.size}, but a group of LeaderWorkerSet ${name} is ${pods_} pods, one rank each`);
  const wantRank = role === 'leader' ? 0 : Number(pod.standins[WORKER_INDEX]);
  if (Number(tp.rank) !== wantRank) errors.push(`${pod.id}: tp.rank ${tp.rank}, but this pod is worker index ${wantRank} of its group`);
  if (pod.owner.spec.startupPolicy === 'LeaderReady') errors.push(`${pod.id}: startupPolicy LeaderReady: the leader turns ready only once every rank joined, which LeaderReady creates only after that`);
  const lead = peers.find((p) => p.labels['pie-tp-role'] === 'leader' && p.svc);
  if (!lead) { errors.push(`${pod.id}: LeaderWorkerSet ${name} has no leader template running pie-worker`); return; }
  checkAddress(`${pod.id}: tp.leader`, tp.leader, 'worker', { podPrefix: `${name}-${pod.standins[GROUP_INDEX]}`, lwsName: name, owner: pod.owner, pods: [lead] });
  const coll = Number((lead.svc.cfg.tp || {}).port);
  if (pod === lead && (!coll || lead.ports.tp !== coll)) errors.push(`${pod.id}: tp.port ${coll} is not the leader container's port "tp" (${lead.ports.tp})`);
  for (const np of docs.filter((d) => d.kind === 'NetworkPolicy' && subset((d.spec.podSelector || {}).matchLabels, lead.labels))) {
    const open = (port) => (np.spec.ingress || []).some((r) => (!r.from || r.from.some((f) => f.podSelector && subset(f.podSelector.matchLabels, pod.labels))) &&
      (!r.ports || r.ports.some((p) => p.port === port)));
    for (const [what, port] of [['gRPC (Worker/TpJoin)', listenPort(lead, 'server')], ['collective (tp.port)', coll || lead.ports.tp]])
      if (!open(port)) errors.push(`${pod.id}: NetworkPolicy/${np.metadata.name} does not let the group's pods reach the leader's ${what} port ${port}`);
  }
}

// The `helm test` pod: every --addr it dials.
for (const pod of pods.filter((p) => p.owner.kind === 'Pod')) {
  for (const c of [...(pod.spec.initContainers || []), ...pod.containers]) {
    const cmd = [...(c.command || []), ...(c.args || [])];
    cmd.forEach((arg, i) => {
      if (arg !== '--addr') return;
      const addr = cmd[i + 1];
      const a = parseAddress(addr);
      const s = a && byKind('Service', a.host.split('.')[0]);
      const comp = s && (s.spec.selector || {})['app.kubernetes.io/component'];
      checkAddress(`${pod.id} ${c.name}: --addr`, addr, SERVICES.includes(comp) ? comp : 'a Pie service');
    });
  }
}
// The gateway test pod: GATEWAY_URL reaches pie-gateway's HTTP port; MODEL is served.
for (const pod of pods.filter((p) => p.owner.kind === 'Pod')) {
  for (const c of pod.containers) {
    const env = expandedEnv(c);
    if (env.GATEWAY_URL === undefined) continue;
    const where = `${pod.id} ${c.name}: GATEWAY_URL`;
    const m = /^http:\/\/([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.([^:/]+):([0-9]+)$/.exec(env.GATEWAY_URL);
    if (!m) { errors.push(`${where}: "${env.GATEWAY_URL}" is not http://<service>.<namespace>.svc.<cluster domain>:<port>`); continue; }
    domains.add(m[3]);
    const s = byKind('Service', m[1]);
    const sp = s && (s.spec.ports || []).find((p) => p.port === Number(m[4]));
    const behind = s ? pods.filter((p) => subset(s.spec.selector, p.labels)) : [];
    if (!s) errors.push(`${where}: "${env.GATEWAY_URL}": no Service ${m[1]} is rendered`);
    else if (!behind.length || behind.some((p) => p.component !== 'gateway')) errors.push(`${where}: "${env.GATEWAY_URL}": Service ${m[1]} does not select the gateway pods`);
    else if (!sp) errors.push(`${where}: "${env.GATEWAY_URL}": Service ${m[1]} has no port ${m[4]}`);
    else {
      for (const p of behind) {
        const got = targetOf(sp, p);
        const want = p.svc ? listenPort(p, 'http') : p.ports.http;
        if (got !== want) errors.push(`${where}: "${env.GATEWAY_URL}" reaches port ${got} of ${p.id}, where pie-gateway serves HTTP on ${want}`);
      }
    }
    const models = new Set(svcPods.filter((p) => p.component === 'worker').map((p) => p.svc.cfg.model.name));
    if (env.MODEL !== undefined && models.size && !models.has(env.MODEL)) errors.push(`${pod.id} ${c.name}: MODEL "${env.MODEL}" is not served by any worker (${[...models].join(', ')})`);
  }
}
if (domains.size > 1) errors.push(`addresses use different cluster domains: ${[...domains].join(', ')}`);

// ---- drain ------------------------------------------------------------------------------------

// Seconds of a duration as the binaries print it ("30s", "1m30s", "500ms"); NaN if unreadable.
function durationSeconds(d) {
  const unit = { ms: 0.001, s: 1, m: 60, h: 3600 };
  let total = 0, rest = String(d);
  const re = /^([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)/;
  if (rest === '0') return 0;
  while (rest.length) {
    const m = re.exec(rest);
    if (!m) return NaN;
    total += Number(m[1]) * unit[m[2]];
    rest = rest.slice(m[0].length);
  }
  return total;
}

for (const pod of svcPods.filter((p) => DRAINS.includes(p.component))) {
  const c = pod.svc.container;
  const pre = ((c.lifecycle || {}).preStop || {}).exec;
  const cmd = (pre && pre.command) || [];
  const sleep = cmd.length === 2 && cmd[0] === 'sleep' ? Number(cmd[1]) : NaN;
  if (!pre) { errors.push(`${pod.id}: container ${c.name} has no preStop hook (exec sleep N)`); continue; }
  if (!Number.isInteger(sleep)) { errors.push(`${pod.id}: preStop runs ${JSON.stringify(cmd)}, not ["sleep", "<seconds>"]`); continue; }
  const grace = durationSeconds(pod.svc.cfg.server.shutdown_grace);
  const term = pod.spec.terminationGracePeriodSeconds === undefined ? 30 : pod.spec.terminationGracePeriodSeconds;
  if (!(term >= sleep + grace + DRAIN_MARGIN_S))
    errors.push(`${pod.id}: terminationGracePeriodSeconds ${term} < preStop sleep ${sleep} + server.shutdown_grace ${pod.svc.cfg.server.shutdown_grace} + ${DRAIN_MARGIN_S}: the pod would be killed mid-drain`);
}

// ---- disk -------------------------------------------------------------------------------------

// Bytes of a Kubernetes quantity ("2Gi", "500M", "1024") or of a size as the binaries print it
// ("4GiB", "512MiB", "1000"); NaN if unreadable.
function bytesOf(q) {
  const unit = { '': 1, B: 1, k: 1e3, K: 1e3, M: 1e6, G: 1e9, T: 1e12, Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40,
    KiB: 2 ** 10, MiB: 2 ** 20, GiB: 2 ** 30, TiB: 2 ** 40 };
  const m = /^([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)$/.exec(String(q).trim());
  return m && unit[m[2]] !== undefined ? Number(m[1]) * unit[m[2]] : NaN;
}

for (const pod of svcPods.filter((p) => p.component === 'lifecycle')) {
  const cfg = pod.svc.cfg;
  const dir = String((cfg.runtime || {}).cache_dir).replace(/\/$/, '');
  const mount = (pod.svc.container.volumeMounts || []).find((m) => m.mountPath.replace(/\/$/, '') === dir);
  const vol = mount && (pod.spec.volumes || []).find((v) => v.name === mount.name);
  if (!vol) { errors.push(`${pod.id}: runtime.cache_dir ${dir} is not a mounted volume`); continue; }
  if (!vol.emptyDir || vol.emptyDir.sizeLimit === undefined) continue;
  const limit = bytesOf(vol.emptyDir.sizeLimit);
  const store = bytesOf((cfg.programs || {}).store_size), cache = bytesOf((cfg.runtime || {}).cache_size);
  const said = `programs.store_size ${(cfg.programs || {}).store_size} + runtime.cache_size ${(cfg.runtime || {}).cache_size}`;
  if (!(store > 0 && cache > 0)) errors.push(`${pod.id}: ${said}: both must be bounded (non-zero) on an emptyDir with sizeLimit ${vol.emptyDir.sizeLimit}`);
  else if (!(store + cache <= 0.75 * limit)) errors.push(`${pod.id}: ${said} is more than 3/4 of the emptyDir's sizeLimit ${vol.emptyDir.sizeLimit} at ${dir}: the kubelet would evict the pod before the service refuses uploads`);
}

// ---- secrets ----------------------------------------------------------------------------------

// The Secret key behind a file path of a container: {secret, key} or an error string.
function secretFile(pod, c, file) {
  for (const m of c.volumeMounts || []) {
    const prefix = m.mountPath.replace(/\/$/, '') + '/';
    if (!file.startsWith(prefix)) continue;
    const v = (pod.spec.volumes || []).find((x) => x.name === m.name);
    if (!v || !v.secret) return `${file} is under ${m.mountPath}, which is not a Secret volume`;
    const rel = file.slice(prefix.length);
    const item = (v.secret.items || []).find((it) => it.path === rel);
    const key = v.secret.items ? (item && item.key) : rel;
    if (!key) return `${file}: Secret volume ${m.name} has no item with path ${rel}`;
    const mode = item && item.mode !== undefined ? item.mode : (v.secret.defaultMode === undefined ? 0o644 : v.secret.defaultMode);
    const psc = pod.spec.securityContext || {};
    const readable = (mode & 0o004) || ((mode & 0o040) && psc.fsGroup !== undefined) || ((mode & 0o400) && psc.runAsUser === 0);
    if (!readable) return `${file}: mode ${mode.toString(8)} is not readable by user ${psc.runAsUser} (fsGroup ${psc.fsGroup})`;
    return { secret: v.secret.secretName, key };
  }
  return `${file} is not under any volume mount`;
}

const tokenSources = []; // [where, "secret/key" or "off"]
for (const pod of svcPods) {
  const auth = pod.svc.cfg.auth || {};
  const where = `${pod.id}: auth.token_file`;
  if (pod.component === 'gateway') {
    // Least privilege: the gateway faces clients and forwards their keys; it needs no token.
    if (auth.token_file || auth.token) errors.push(`${pod.id}: pie-gateway is given the cluster token (auth.${auth.token_file ? 'token_file' : 'token'}); it needs none: it forwards each client's key`);
    // The TLS Secret (tls.*) is the only one it may mount: its certificate and the CA.
    const tlsDir = ((pod.svc.cfg.tls || {}).ca_file || '').replace(/\/[^/]*$/, '');
    const tlsVolumes = new Set((pod.svc.container.volumeMounts || []).filter((m) => tlsDir && m.mountPath === tlsDir).map((m) => m.name));
    if ((pod.spec.volumes || []).some((v) => v.secret && !tlsVolumes.has(v.name))) errors.push(`${pod.id}: the gateway pod mounts a Secret; it needs none`);
    continue;
  }
  if (!auth.token_file) {
    tokenSources.push([pod.id, auth.token ? 'a literal auth.token' : 'off']);
    continue;
  }
  const r = secretFile(pod, pod.svc.container, auth.token_file);
  if (typeof r === 'string') { errors.push(`${where}: ${r}`); continue; }
  tokenSources.push([pod.id, `Secret ${r.secret} key ${r.key}`]);
  const s = byKind('Secret', r.secret);
  if (!s && !externalSecrets.has(r.secret)) errors.push(`${where}: Secret ${r.secret} is neither rendered nor --external-secret`);
  else if (s && !({ ...(s.data || {}), ...(s.stringData || {}) })[r.key]) errors.push(`${where}: Secret ${r.secret} has no key ${r.key}`);
}
for (const pod of pods.filter((p) => p.owner.kind === 'Pod')) {
  for (const c of pod.containers) {
    const e = (c.env || []).find((x) => x.name === 'PIE_TOKEN');
    const skr = e && e.valueFrom && e.valueFrom.secretKeyRef;
    if (e && !skr) errors.push(`${pod.id} ${c.name}: PIE_TOKEN is not taken from a Secret`);
    const src = skr ? `Secret ${skr.name} key ${skr.key}` : 'off';
    tokenSources.push([`${pod.id} ${c.name}`, src]);
    if (skr) {
      const s = byKind('Secret', skr.name);
      if (s && !({ ...(s.data || {}), ...(s.stringData || {}) })[skr.key]) errors.push(`${pod.id} ${c.name}: PIE_TOKEN: Secret ${skr.name} has no key ${skr.key}`);
    }
  }
}
const distinct = new Set(tokenSources.map(([, s]) => s));
if (distinct.size > 1) errors.push(`the token differs between pods: ${tokenSources.map(([w, s]) => `${w} uses ${s}`).join('; ')}`);

fs.rmSync(tmp, { recursive: true, force: true });

// ---- report -----------------------------------------------------------------------------------

if (errors.length) {
  console.log(`FAIL ${files[0]}: ${errors.length} problem(s)`);
  for (const e of errors) console.log(`  ${e}`);
  process.exit(1);
}
const workers = svcPods.filter((p) => p.component === 'worker')
  .map((p) => `${p.id}: backend ${String(p.svc.cfg.backend)}, ${gpusRequested(p.svc.container)} GPU(s)`);
console.log(`ok ${files[0]}: ${svcPods.length} service pod template(s) line up (ports, probes, addresses; token: ${[...distinct].join(', ')}); ${workers.join('; ')}`);
