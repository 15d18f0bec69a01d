// "Anatomy of a step": one optimizer step of a stage, drawn for the sliders' settings.
//
// The step is computed here, in the browser, by the step model's event loop
// (profiling/simulate/schedule.py, simulate(), with no sharing: backward runs at its
// own speed whatever is in flight, and one collective is served at a time), on the
// data python -m profiling.course.anatomy --docs writes into anatomy-workload.js. With no
// sharing the loop has a closed form: a bucket is launched once its last gradient is
// ready and every earlier bucket was launched, and it starts once the collective
// before it has ended. profiling/course/anatomy.py's step() is the same computation in
// Python; the docs' browser test checks one against the other on a grid.
(function () {
  "use strict";
  const data = window.ANATOMY;

  let model = null; // data.models[the selected one]

  function cost(bytes, gbitS, messageLatencyS) {
    const ranks = data.ranks;
    const latency = 2 * (ranks - 1) * messageLatencyS; // 2(p-1) messages of a ring
    const wire = ((2 * (ranks - 1)) / ranks) * bytes * 8 / (gbitS * 1e9);
    return latency + wire;
  }

  function bucketBytes(bucket) {
    return bucket.reduce((sum, i) => sum + model.grads[i].bytes, 0);
  }

  // One synchronised micro-batch from t: forward, backward, the all-reduces; returns
  // its end (before the optimizer), pushing its segments.
  function synchronised(t, buckets, overlap, gbitS, latencyS, segments) {
    const f = model.forward_s, b = model.backward_s;
    segments.push({ lane: "compute", label: "forward", start: t, end: t + f });
    const start = t + f;
    if (!overlap) {
      segments.push({ lane: "compute", label: "backward", start: start, end: start + b });
      let u = start + b;
      buckets.forEach((bucket, index) => {
        const c = cost(bucketBytes(bucket), gbitS, latencyS);
        segments.push({ lane: "comm", label: "bucket " + index, start: u, end: u + c });
        u += c;
      });
      return u;
    }
    segments.push({ lane: "compute", label: "backward", start: start, end: start + b });
    let launched = start, free = start, last = start + b;
    buckets.forEach((bucket, index) => {
      const full = start + Math.max(...bucket.map((i) => model.grads[i].ready_s));
      launched = Math.max(launched, full); // buckets go out in bucket order
      const begin = Math.max(launched, free); // one collective at a time
      free = begin + cost(bucketBytes(bucket), gbitS, latencyS);
      segments.push({ lane: "comm", label: "bucket " + index, start: begin, end: free });
      last = Math.max(last, free);
    });
    return last;
  }

  // The step of `stage` on data.models[name] with its layouts[layout]: see
  // profiling/course/anatomy.py's step() and bound_s().
  function step(name, stage, layout, gbitS, latencyS, microBatches) {
    model = data.models[name];
    const buckets = model.layouts[stage === "naive" ? "naive" : layout];
    const overlap = stage === "overlapped" || stage === "skip_sync";
    const f = model.forward_s, b = model.backward_s, o = model.optimizer_s;
    const segments = [];
    let t = 0;
    const unsynced = stage === "skip_sync" ? microBatches - 1 : 0;
    for (let m = 0; m < unsynced; m++) {
      segments.push({ lane: "compute", label: "forward", start: t, end: t + f });
      segments.push({ lane: "compute", label: "backward", start: t + f, end: t + f + b });
      t += f + b;
    }
    for (let m = unsynced; m < microBatches; m++) {
      t = synchronised(t, buckets, overlap, gbitS, latencyS, segments);
    }
    segments.push({ lane: "compute", label: "optimizer", start: t, end: t + o });
    const comm = buckets.reduce((s, bk) => s + cost(bucketBytes(bk), gbitS, latencyS), 0);
    const synced = microBatches - unsynced;
    return {
      step_s: t + o,
      compute_s: microBatches * (f + b) + o,
      comm_s: comm,
      bound_s: unsynced * (f + b) + synced * (f + Math.max(b, comm)) + o,
      buckets: buckets.length,
      segments: segments,
    };
  }
  window.anatomyStep = step; // for the browser test

  // ---- the page: controls, drawing ----
  const COLOURS = { forward: "#8fb3de", backward: "#4c72b0", optimizer: "#8172b2", comm: "#dd8452" };
  const SVG = "http://www.w3.org/2000/svg";

  function el(name, attrs, text) {
    const node = document.createElementNS(SVG, name);
    for (const k in attrs) node.setAttribute(k, attrs[k]);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function gbitOf(position) {
    return Math.pow(10, -1 + (3 * position) / 30); // 0.1 .. 100 Gbit/s, log steps
  }

  // Latency per message, µs: 1-2-5 steps from a microsecond (one rack) to 2 ms.
  const LATENCY_US = [0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000];

  function latencyLabel(us) {
    return us === 0 ? "none" : us < 1000 ? us + " µs" : us / 1000 + " ms";
  }

  // The cap slider: one parameter per bucket, then each of the model's cap groups (caps
  // that give one layout), so that every position changes the layout.
  function capPosition(m, capMb) {
    if (capMb === "per_parameter") return 0;
    return 1 + m.cap_groups.findIndex((g) => g.caps_mb.includes(Number(capMb)));
  }

  function capLabelOf(group) {
    const caps = group.caps_mb;
    return caps.length === 1 ? caps[0] + " MiB" : caps[0] + "–" + caps[caps.length - 1] + " MiB";
  }

  function ms(seconds) {
    return (seconds * 1e3).toLocaleString("en", { maximumFractionDigits: seconds < 0.1 ? 1 : 0 });
  }

  function draw(root) {
    const q = (name) => root.querySelector("[name=" + name + "]");
    const stage = q("stage").value;
    const name = q("model").value;
    const m = data.models[name];
    const cap = q("cap");
    if (root.dataset.model !== name) { // another model: its caps, at the same cap where it can
      cap.max = String(m.cap_groups.length);
      if (root.dataset.model) cap.value = String(Math.max(0, capPosition(m, root.dataset.cap)));
      root.dataset.model = name;
    }
    const group = Number(cap.value) === 0 ? null : m.cap_groups[Number(cap.value) - 1];
    const layout = group ? group.layout : "per_parameter";
    root.dataset.cap = layout;
    const gbit = gbitOf(Number(q("bandwidth").value));
    const latencyUs = LATENCY_US[Number(q("latency").value)];
    const micro = Number(q("micro").value);
    const s = step(name, stage, layout, gbit, latencyUs / 1e6, micro);
    const capLabel = stage === "naive" ? "naive: one all-reduce per parameter"
      : group ? capLabelOf(group) : "one parameter per bucket";
    cap.disabled = stage === "naive";
    root.querySelector("[data-out=bandwidth]").textContent = gbit.toPrecision(2) + " Gbit/s";
    root.querySelector("[data-out=latency]").textContent = latencyLabel(latencyUs);
    root.querySelector("[data-out=cap]").textContent = capLabel + " (" + s.buckets + " all-reduces)";
    root.querySelector("[data-out=micro]").textContent = String(micro);
    root.querySelector("[data-out=summary]").textContent =
      "step " + ms(s.step_s) + " ms, " + ms(s.step_s / micro) + " ms per micro-batch: " +
      (s.step_s / s.compute_s).toFixed(2) + "x compute alone (" + ms(s.compute_s) + " ms), " +
      (s.step_s / s.bound_s).toFixed(2) + "x the bound (" + ms(s.bound_s) + " ms). " +
      "One synchronisation's all-reduces back to back: " + ms(s.comm_s) + " ms.";

    const svg = root.querySelector("svg");
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const width = 760, left = 90, right = 10, span = Math.max(s.step_s, s.bound_s) * 1.02;
    const x = (t) => left + ((width - left - right) * t) / span;
    const lanes = { compute: 10, comm: 50 };
    svg.appendChild(el("text", { x: 0, y: 30, "font-size": 13 }, "compute"));
    svg.appendChild(el("text", { x: 0, y: 70, "font-size": 13 }, "all-reduce"));
    s.segments.forEach((seg) => {
      const colour = seg.lane === "comm" ? COLOURS.comm : COLOURS[seg.label];
      const rect = el("rect", {
        x: x(seg.start), y: lanes[seg.lane], height: 28,
        width: Math.max(0.5, x(seg.end) - x(seg.start)),
        fill: colour, stroke: "white", "stroke-width": 0.6, "data-lane": seg.lane,
      });
      rect.appendChild(el("title", {}, seg.label + ": " + ms(seg.start) + " to " + ms(seg.end) + " ms"));
      svg.appendChild(rect);
    });
    [["bound", s.bound_s, "#333"], ["step", s.step_s, "#c44e52"]].forEach(([name, t, colour]) => {
      svg.appendChild(el("line", { x1: x(t), x2: x(t), y1: 4, y2: 84, stroke: colour,
        "stroke-width": 1.5, "stroke-dasharray": name === "bound" ? "4 3" : "" }));
      svg.appendChild(el("text", { x: x(t) - 2, y: name === "bound" ? 98 : 112, "font-size": 12,
        "text-anchor": "end", fill: colour }, name + " " + ms(t) + " ms"));
    });
    for (let i = 0; i <= 4; i++) { // a time axis in ms; the last label ends at the edge
      const t = (span * i) / 4;
      svg.appendChild(el("text", { x: x(t), y: 128, "font-size": 11,
        "text-anchor": i === 4 ? "end" : "middle", fill: "#666" }, ms(t) + (i === 4 ? " ms" : "")));
    }
  }

  function setUp(root) {
    root.querySelectorAll("input, select").forEach((input) =>
      input.addEventListener("input", () => draw(root)));
    draw(root);
  }

  function start() {
    document.querySelectorAll(".anatomy").forEach(setUp);
  }
  // Material's instant loading replaces the page without a new load event.
  if (window.document$ && window.document$.subscribe) window.document$.subscribe(start);
  else if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
