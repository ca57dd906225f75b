/* slurm-gpuprof HTML report: draws the payload of mpi_merge/html_report.py with Apache ECharts.
 * Names from traces go into the DOM as text nodes (el(), textContent) and into chart tooltips
 * through esc(); nothing is fetched. Each section sets data-rendered="1" when drawn, and the page
 * sets #gp-done[data-ms] when the last one is: the browser tests and the bench read those. */
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("gp-data").textContent);
  var S = D.strings;
  var G = D.grid;
  var T1 = G.t0 + G.dt * G.bins;
  var charts = [];
  // a large chart paints over several animation frames after the script: #gp-done gets
  // data-painted-ms once the script has run and every chart has finished its first rendering
  var scriptDone = false;
  function chartPainted() {
    var left = charts.filter(function (c) { return !c.__gpPainted; }).length;
    var done = document.getElementById("gp-done");
    if (!scriptDone || left || !done || done.hasAttribute("data-painted-ms")) return;
    var ms = Math.round(performance.now());
    done.setAttribute("data-painted-ms", String(ms));
    done.textContent += ", painted in " + ms + " ms";
  }
  var timeCharts = [];
  var app = document.getElementById("gp-app");

  function esc(x) {
    return String(x).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }
  function el(tag, attrs, kids) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) {
      if (k === "text") e.textContent = attrs[k];
      else if (k === "cls") e.className = attrs[k];
      else e.setAttribute(k, attrs[k]);
    }
    (kids || []).forEach(function (c) {
      if (c === null || c === undefined) return;
      e.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return e;
  }
  function fmt(x, d) {
    if (x === null || x === undefined || (typeof x === "number" && !isFinite(x))) return "n/a";
    if (typeof x === "number" && Number.isInteger(x)) return String(x);
    return typeof x === "number" ? x.toFixed(d === undefined ? 1 : d) : String(x);
  }
  function pct(x) {
    if (x === null || x === undefined || !isFinite(x)) return "n/a";
    return (100 * x).toFixed(Math.abs(x) < 0.1 && x !== 0 ? 1 : 0) + "%";
  }
  function section(id, title, help) {
    var s = el("section", { id: "sec-" + id, "data-section": id }, [el("h2", { text: title })]);
    if (help) s.appendChild(el("p", { cls: "help", text: help }));
    app.appendChild(s);
    return s;
  }
  function chartDiv(parent, h, cls) {
    var d = el("div", { cls: "chart " + (cls || ""), style: "height:" + h + "px" });
    parent.appendChild(d);
    var c = echarts.init(d, null, { renderer: "canvas" });
    charts.push(c);
    // before any setOption: a chart drawn at once says so inside it
    c.on("finished", function () { if (!c.__gpPainted) { c.__gpPainted = true; chartPainted(); } });
    return c;
  }
  function table(headers, rows) {
    var t = el("table", null, [el("tr", null, headers.map(function (h) { return el("th", { text: h }); }))]);
    rows.forEach(function (r) {
      t.appendChild(el("tr", null, r.map(function (v) { return el("td", { text: fmt(v, 2) }); })));
    });
    return t;
  }
  function notRecorded(parent, what) { parent.appendChild(el("p", { cls: "none", text: what + ": not recorded" })); }
  function waitColor(v, vmax) {
    if (v === null || v === undefined) return "#bbbbbb";
    var x = Math.max(0, Math.min(1, v / (vmax || 1)));
    var r = Math.round(158 + (214 - 158) * x), g = Math.round(202 + (39 - 202) * x), b = Math.round(225 + (40 - 225) * x);
    return "rgb(" + r + "," + g + "," + b + ")";
  }
  function p99(vals) {
    var a = vals.filter(function (v) { return v !== null && isFinite(v); }).sort(function (x, y) { return x - y; });
    return a.length ? (a[Math.floor(0.99 * (a.length - 1))] || a[a.length - 1] || 1) : 1;
  }
  var timeZoom = [{ type: "inside", xAxisIndex: 0, filterMode: "weakFilter" },
                  { type: "slider", xAxisIndex: 0, height: 16, bottom: 4, filterMode: "weakFilter" }];
  function timeAxis() {
    return { type: "value", min: G.t0, max: T1, name: "aligned time (s)", nameLocation: "middle", nameGap: 22,
             axisLabel: { formatter: function (v) { return v.toFixed(2); } } };
  }

  // --- summary -------------------------------------------------------------------------------
  function renderSummary() {
    var s = section("summary", "gpuprof job " + D.job_id + ": " + D.status);
    var sm = D.summary;
    var verdict = sm.stragglers.length
      ? "Root cause: " + sm.stragglers.map(function (x) {
          return x.node + " (" + x.cause + (x.kind ? ", " + x.kind : "") + ") cost " + fmt(x.cost_ns / 1e6, 1) +
            " ms of the others' waiting (" + pct(x.cost_share) + " of the job's waits)";
        }).join("; ")
      : "No straggler: no rank was the origin of the others' waits more often or longer than chance, noise and the clock error explain.";
    s.appendChild(el("p", { cls: "verdict", id: "gp-verdict", text: verdict }));
    var ul = el("ul", { id: "gp-stragglers" });
    sm.stragglers.forEach(function (x) {
      var li = el("li", null, [el("b", { text: x.node }), " ranks " + (x.ranks || []).join(",") + " of " + x.comm_id +
        ": last in " + pct(x.share_last) + " of instances (expected " + pct(x.expected_share) + "), t=" +
        fmt(x.first_s, 0) + "-" + fmt(x.last_s, 0) + " s"]);
      var ev = el("ul");
      if (x.phase) ev.appendChild(el("li", { text: "NVTX phase: " + (typeof x.phase === "string" ? x.phase : JSON.stringify(x.phase)) }));
      if (x.kernel) ev.appendChild(el("li", { text: "GPU kernel: " + (typeof x.kernel === "string" ? x.kernel : JSON.stringify(x.kernel)) }));
      Object.keys(x.stacks || {}).forEach(function (k) {
        var st = x.stacks[k];
        if (st && st.path && k === "kernel_launch") ev.appendChild(el("li", { cls: "where", text: "its " + st.kernel +
          " kernels were launched from " + st.path.join(" \u2192 ") + " (" + pct(st.share_of_launches) + " of " + st.launches + " launches)" }));
        else if (st && st.path) ev.appendChild(el("li", { cls: "where", text: "where the extra " + (k === "cpu" ? "CPU samples" : k === "offcpu" ? "off-CPU time" : k) +
          " went: " + pct(st.share_of_extra) + " in " + st.path.join(" \u2192 ") }));
      });
      (x.propagated || []).forEach(function (p) {
        ev.appendChild(el("li", { text: "propagated: " + fmt(p.wait_ns / 1e6, 1) + " ms on " + p.comm_id }));
      });
      (x.evidence || []).forEach(function (e) { ev.appendChild(el("li", { text: e })); });
      li.appendChild(ev);
      ul.appendChild(li);
    });
    s.appendChild(ul);
    var c = sm.clock || {};
    var worst = D.clock_table.reduce(function (m, n) { return Math.max(m, n.uncertainty_us || 0); }, 0);
    s.appendChild(el("p", { text: "Clocks: method " + c.method + ", reference " + c.reference + ", " +
      c.instances_used + " instances used, causality violations after alignment: " + c.causality_violations +
      ", widest error interval +-" + fmt(worst, 1) + " us; " + sm.nodes_merged + " node(s) merged" }));
    s.appendChild(el("h3", { text: "Missing or excluded" }));
    var miss = el("ul", { id: "gp-missing" });
    (sm.partial_reasons.length ? sm.partial_reasons : ["nothing"]).slice(0, 60).forEach(function (m) {
      miss.appendChild(el("li", { text: m }));
    });
    if (sm.partial_reasons.length > 60) miss.appendChild(el("li", { text: "... and " + (sm.partial_reasons.length - 60) + " more (JSON report)" }));
    s.appendChild(miss);
    s.appendChild(el("h3", { text: "What was recorded" }));
    var cov = el("ul", { id: "gp-coverage" });
    D.coverage.forEach(function (c) {
      var line = c.source + " (" + c.table + "): " + (c.nodes === c.of ? "all " + c.of + " nodes" :
        c.nodes ? c.nodes + " of " + c.of + " nodes" : "not recorded");
      if (c.nodes && c.nodes < c.of || c.table === "/diagnostics/missing") line += "; " + c.without.join(", ");
      cov.appendChild(el("li", { cls: c.nodes ? "" : "none", text: line }));
    });
    s.appendChild(cov);
    if (sm.mismatches.length) {
      s.appendChild(el("h3", { text: "Mismatches" }));
      var mm = el("ul");
      sm.mismatches.forEach(function (m) {
        mm.appendChild(el("li", { text: m.comm_id + " " + m.kind + " at seq " + m.first_seq + ": " + m.detail }));
      });
      s.appendChild(mm);
    }
    if (sm.idle_gpus.length) {
      s.appendChild(el("p", { text: "Idle or underused GPUs: " + sm.idle_gpus.map(function (g) {
        return g.node + " gpu" + g.gpu + " (" + g.verdict + ", " + fmt(g.activity_mean, 0) + "%)"; }).join(", ") }));
    }
    s.appendChild(el("h3", { text: "What this page summarized" }));
    var su = el("ul", { id: "gp-summarized" });
    (D.summarized.length ? D.summarized : ["nothing: every instance, series and row is drawn"]).forEach(function (m) {
      su.appendChild(el("li", { text: m }));
    });
    s.appendChild(su);
  }

  // --- drill-down ------------------------------------------------------------------------------
  var drillBox;
  function stackWindow(rows) {
    var ts = {};
    rows.forEach(function (r) { ts[r[0]] = 1; });
    var u = Object.keys(ts).map(Number).sort(function (a, b) { return a - b; });
    var d = [];
    for (var i = 1; i < u.length; i++) d.push(u[i] - u[i - 1]);
    d.sort(function (a, b) { return a - b; });
    return d.length ? d[Math.floor(d.length / 2)] : 1.0;
  }
  function topStacks(node, rows, t0, t1, n) {
    // by the innermost frame of the program (the user part of the stack; the kernel's leaf after it):
    // "where was it" reads better than a list of whole stacks that differ in one kernel frame
    var win = stackWindow(rows), R = D.node_rows[node];
    var acc = {}, example = {}, total = 0;
    rows.forEach(function (r) {
      if (r[0] + win < t0 || r[0] > t1 || !(r[2] > 0)) return;
      var st = R.stacks[r[1]], u = R.user_frames[r[1]];
      var user = u > 0 ? S[st[u - 1]] : "[no user frame]";
      var key = user + (st.length > u ? "  [kernel: " + S[st[st.length - 1]] + "]" : "");
      acc[key] = (acc[key] || 0) + r[2];
      if (!example[key] || r[2] > example[key][1]) example[key] = [r[1], r[2]];
      total += r[2];
    });
    var keys = Object.keys(acc).sort(function (a, b) { return acc[b] - acc[a]; }).slice(0, n);
    return { total: total, win: win, top: keys.map(function (k) {
      return { label: k, w: acc[k], frames: R.stacks[example[k][0]].map(function (i) { return S[i]; }) }; }) };
  }
  function drillNode(node, t0, t1, why) {
    var R = D.node_rows[node];
    var card = el("div", { cls: "drillcard", "data-node": node }, [el("h4", { text: node + (why ? " (" + why + ")" : "") })]);
    if (!R) { card.appendChild(el("p", { text: "no rows for this node" })); return card; }
    [["samples", "On-CPU stacks", "samples"], ["offcpu", "Off-CPU stacks", "ms blocked"]].forEach(function (k) {
      card.appendChild(el("h5", { text: k[1] }));
      if (R[k[0]] === null) { notRecorded(card, k[1]); return; }
      var st = topStacks(node, R[k[0]], t0, t1, 6);
      if (!st.top.length) { card.appendChild(el("p", { cls: "none", text: "none in this window" })); return; }
      var ol = el("ol", { cls: "stacks" });
      st.top.forEach(function (x) {
        ol.appendChild(el("li", { title: "heaviest stack, root first: " + x.frames.join(" > ") },
          [fmt(x.w, 0) + " " + k[2] + " (" + pct(x.w / st.total) + "): ", el("code", { text: x.label })]));
      });
      card.appendChild(ol);
    });
    card.appendChild(el("h5", { text: "NVTX ranges" }));
    if (R.nvtx === null) notRecorded(card, "NVTX ranges");
    else {
      var nv = R.nvtx.filter(function (r) { return r[1] >= t0 && r[0] <= t1; }).slice(0, 12);
      if (!nv.length) card.appendChild(el("p", { cls: "none", text: "none in this window" }));
      nv.forEach(function (r) {
        card.appendChild(el("div", { cls: "nvtx" }, [el("code", { text: S[r[2]] }), " " + fmt((r[1] - r[0]) * 1e3, 2) +
          " ms, depth " + r[3] + ", tid " + r[4]]));
      });
    }
    card.appendChild(el("h5", { text: "Kernels launched" }));
    if (R.kernels === null) notRecorded(card, "Kernel launches");
    else {
      var kc = {};
      R.kernels.forEach(function (r) { if (r[0] >= t0 && r[0] <= t1) kc[r[1]] = (kc[r[1]] || 0) + 1; });
      var ks = Object.keys(kc).sort(function (a, b) { return kc[b] - kc[a]; }).slice(0, 8);
      if (!ks.length) card.appendChild(el("p", { cls: "none", text: "none in this window" }));
      ks.forEach(function (k) { card.appendChild(el("div", null, [kc[k] + " x ", el("code", { text: S[k] })])); });
    }
    return card;
  }
  function drill(title, t0, t1, nodes) {
    drillBox.textContent = "";
    drillBox.appendChild(el("p", { cls: "drilltitle", id: "gp-drill-title", text: title + ": window " + fmt(t0, 3) +
      " - " + fmt(t1, 3) + " s (stacks are sampled in windows of about a second: rows overlapping it are counted)" }));
    var row = el("div", { cls: "drillrow" });
    nodes.slice(0, 6).forEach(function (n) { row.appendChild(drillNode(n[0], t0, t1, n[1])); });
    drillBox.appendChild(row);
  }
  function renderDrillShell() {
    var s = section("drill", "Drill-down: what each node did before the moment clicked",
      "Click a collective instance in the lanes or a point of a metric: the stacks, off-CPU stacks, NVTX ranges and kernels of that window on that node (and, for an instance, on the node that arrived last and its peers).");
    drillBox = el("div", { id: "gp-drill" }, [el("p", { text: "nothing selected yet" })]);
    s.appendChild(drillBox);
    return s;
  }

  // --- lanes per communicator ----------------------------------------------------------------
  var laneChart;
  // the wait heat map on a canvas of its own: one pixel per cell, scaled (tens of thousands of
  // cells as chart items cost a second to lay out; as an image, milliseconds)
  function heatColor(x) {
    var a = [247, 251, 255], b = [253, 174, 107], c = [214, 39, 40];
    var lo = x < 0.5 ? a : b, hi = x < 0.5 ? b : c, f = x < 0.5 ? x * 2 : (x - 0.5) * 2;
    return [0, 1, 2].map(function (i) { return Math.round(lo[i] + (hi[i] - lo[i]) * f); });
  }
  function drawHeat(box, c, labels) {
    box.textContent = "";
    var rows = c.heat.ms.length, cols = rows ? c.heat.ms[0].length : 0;
    var W = Math.max(600, box.clientWidth || 1200), left = 110, right = 70, top = 6, bottom = 40;
    var H = Math.max(160, Math.min(900, top + bottom + rows * 3));
    var cv = el("canvas", { width: String(W), height: String(H), style: "width:" + W + "px;height:" + H + "px" });
    var tip = el("div", { cls: "heattip", id: "gp-heat-tip" });
    box.appendChild(cv);
    box.appendChild(tip);
    var ctx = cv.getContext("2d"), vals = [];
    c.heat.ms.forEach(function (row) { row.forEach(function (v) { if (v !== null) vals.push(v); }); });
    var vmax = p99(vals) || 1;
    var img = document.createElement("canvas");
    img.width = Math.max(1, cols);
    img.height = Math.max(1, rows);
    var ictx = img.getContext("2d"), data = ictx.createImageData(img.width, img.height);
    c.heat.ms.forEach(function (row, r) {
      row.forEach(function (v, j) {
        var o = 4 * (r * img.width + j), rgb = v === null ? [220, 220, 220] : heatColor(Math.min(1, v / vmax));
        data.data[o] = rgb[0]; data.data[o + 1] = rgb[1]; data.data[o + 2] = rgb[2]; data.data[o + 3] = 255;
      });
    });
    ictx.putImageData(data, 0, 0);
    var gw = W - left - right, gh = H - top - bottom;
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(img, left, top, gw, gh);
    ctx.fillStyle = "#333";
    ctx.font = "9px sans-serif";
    var every = Math.max(1, Math.ceil(10 / (gh / Math.max(1, rows))));
    for (var r = 0; r < rows; r += every) ctx.fillText(labels[r], 2, top + (r + 0.5) * gh / rows + 3);
    ctx.font = "10px sans-serif";
    for (var k = 0; k <= 10 && cols; k++) {
      var j = Math.min(cols - 1, Math.round(k * (cols - 1) / 10));
      ctx.fillText(String(c.heat.edges[j]), left + j * gw / cols, top + gh + 14);
    }
    ctx.fillText("collective index (first seq of the group)", left + gw / 2 - 100, top + gh + 30);
    for (var y = 0; y < 120; y++) {  // the colour scale
      var rgb = heatColor(1 - y / 119);
      ctx.fillStyle = "rgb(" + rgb.join(",") + ")";
      ctx.fillRect(W - right + 20, top + 14 + y, 14, 1);
    }
    ctx.fillStyle = "#333";
    ctx.fillText(fmt(vmax, 2) + " ms", W - right + 14, top + 10);
    ctx.fillText("0", W - right + 22, top + 146);
    cv.addEventListener("mousemove", function (e) {
      var j = Math.floor((e.offsetX - left) / gw * cols), r = Math.floor((e.offsetY - top) / gh * rows);
      if (j < 0 || j >= cols || r < 0 || r >= rows) { tip.style.display = "none"; return; }
      var v = c.heat.ms[r][j];
      tip.textContent = labels[r] + ", seq " + c.heat.edges[j] + "-" + (c.heat.edges[j + 1] - 1) + ": mean wait " + fmt(v, 3) + " ms";
      tip.style.display = "block";
      tip.style.left = (e.offsetX + 12) + "px";
      tip.style.top = (e.offsetY + 12) + "px";
    });
    cv.addEventListener("mouseleave", function () { tip.style.display = "none"; });
  }
  function renderLanes() {
    var s = section("lanes", "Collectives: lanes per rank of every communicator",
      "By collective index: the wait of each rank (rows) over groups of instances (columns), red = long. By aligned time: each rank's calls from enter to exit, coloured by its wait; black outline = the last to arrive. Click a call to drill down.");
    if (!D.comms.length) { notRecorded(s, "Collectives"); return; }
    var sel = el("select", { id: "gp-comm" });
    D.comms.forEach(function (c, i) {
      sel.appendChild(el("option", { value: String(i), text: c.id + " (" + c.size + " ranks, " + c.instances + " instances)" }));
    });
    s.appendChild(el("label", null, ["communicator ", sel]));
    var info = el("p", { cls: "help" });
    s.appendChild(info);
    s.appendChild(el("h3", { text: "By collective index (wait heat map)" }));
    var heatBox = el("div", { cls: "heat", id: "gp-heat" });
    s.appendChild(heatBox);
    s.appendChild(el("h3", { text: "By aligned time" }));
    var btn = el("button", { type: "button", id: "gp-zoom-lanes", text: "show the lanes' window in every timeline" });
    s.appendChild(btn);
    laneChart = chartDiv(s, Math.max(240, Math.min(1100, 60 + D.comms[0].ranks.length * 4)));
    timeCharts.push(laneChart);
    function draw(ci) {
      var c = D.comms[ci];
      var pats = Object.keys(c.patterns || {}).map(function (k) { return k + " " + c.patterns[k].instances + " inst, " + fmt(c.patterns[k].wait_ms_total, 1) + " ms"; });
      info.textContent = c.complete + "/" + c.instances + " complete instances; arrival skew median " +
        fmt(c.skew_ms.median, 3) + " ms, p99 " + fmt(c.skew_ms.p99, 3) + " ms; " + (pats.join("; ") || "no wait pattern");
      var labels = c.ranks.map(function (r, k) { return "r" + r + " " + (c.rank_nodes[k] === null ? "?" : c.rank_nodes[k]); });
      drawHeat(heatBox, c, labels);
      var cells = c.cells, wmax = p99(cells.map(function (x) { return x[4]; }));
      var lo = Infinity, hi = -Infinity;
      cells.forEach(function (x) { lo = Math.min(lo, x[2]); hi = Math.max(hi, x[3]); });
      if (!cells.length) { lo = G.t0; hi = T1; }  // a communicator without a complete call
      laneChart.setOption({
        animation: false, grid: { left: 110, right: 20, top: 10, bottom: 54 },
        tooltip: { formatter: function (p) {
          var x = p.value;
          return esc(labels[x[0]]) + "<br>seq " + x[1] + " " + esc(D.op_names[x[5]] || "op " + x[5]) +
            "<br>enter " + x[2].toFixed(6) + " s, " + fmt((x[3] - x[2]) * 1e3, 3) + " ms<br>wait " + fmt(x[4], 3) + " ms" +
            (x[6] ? "<br><b>arrived last</b>" : ""); } },
        xAxis: timeAxis(),
        yAxis: { type: "category", data: labels, inverse: true, axisLabel: { fontSize: 9 } },
        dataZoom: [{ type: "inside", xAxisIndex: 0, filterMode: "weakFilter", startValue: lo, endValue: hi },
                   { type: "slider", xAxisIndex: 0, height: 16, bottom: 4, filterMode: "weakFilter", startValue: lo, endValue: hi },
                   { type: "inside", yAxisIndex: 0, filterMode: "none" }],
        series: [{ type: "custom", encode: { x: [2, 3], y: 0 }, data: cells, progressive: 0, progressiveThreshold: 1e9,
          renderItem: function (params, api) {
            var a = api.coord([api.value(2), api.value(0)]), b = api.coord([api.value(3), api.value(0)]);
            var hgt = Math.max(1, api.size([0, 1])[1] * 0.8);
            var rect = echarts.graphic.clipRectByRect({ x: a[0], y: a[1] - hgt / 2, width: Math.max(1, b[0] - a[0]), height: hgt },
              { x: params.coordSys.x, y: params.coordSys.y, width: params.coordSys.width, height: params.coordSys.height });
            return rect && { type: "rect", shape: rect, style: { fill: waitColor(api.value(4), wmax),
              stroke: api.value(6) ? "#000" : null, lineWidth: api.value(6) ? 1 : 0 } };
          } }]
      }, true);
      laneChart.__window = [lo, hi];
    }
    sel.addEventListener("change", function () { draw(Number(sel.value)); });
    draw(0);
    laneChart.on("click", function (p) {
      var c = D.comms[Number(sel.value)], x = p.value;
      var node = c.rank_nodes[x[0]];
      // the compute interval before it: from this rank's previous exit (if drawn) to its enter
      var prev = null, lastNode = null;
      c.cells.forEach(function (y) {
        if (y[0] === x[0] && y[1] === x[1] - 1) prev = y[3];
        if (y[1] === x[1] && y[6]) lastNode = c.rank_nodes[y[0]];
      });
      var t1 = x[2], t0 = Math.min(prev === null ? t1 - 1 : prev, t1 - 0.001);
      var nodes = [[node, "the rank clicked"]];
      if (lastNode && lastNode !== node) nodes.push([lastNode, "arrived last"]);
      c.rank_nodes.forEach(function (n) {
        if (n !== null && !nodes.some(function (m) { return m[0] === n; })) nodes.push([n, "peer"]);
      });
      drill("Instance seq " + x[1] + " of " + c.id + ", rank " + c.ranks[x[0]], t0, t1, nodes);
    });
    btn.addEventListener("click", function () {
      var w = laneChart.__window;
      timeCharts.forEach(function (ch) { ch.dispatchAction({ type: "dataZoom", startValue: w[0], endValue: w[1] }); });
    });
  }

  // --- metric timelines ------------------------------------------------------------------------
  function renderMetrics() {
    var s = section("metrics", "Metric timelines per node and GPU",
      "On the aligned time axis of the lanes (zoom one, all follow). Click a point: the drill-down shows that node's stacks, NVTX ranges and kernels of that moment.");
    if (!D.metrics.length) { notRecorded(s, "GPU and host metrics"); return; }
    var xs = [];
    for (var i = 0; i < G.bins; i++) xs.push(G.t0 + (i + 0.5) * G.dt);
    D.metrics.forEach(function (m) {
      s.appendChild(el("h3", { text: m.title + " (" + m.unit + ", " + m.source + ", " + m.nodes + " node(s))" }));
      var ch = chartDiv(s, 190, "metric");
      ch.getDom().setAttribute("data-metric", m.key);
      timeCharts.push(ch);
      var series = [];
      if (m.band) {
        series.push({ name: "p10", type: "line", data: xs.map(function (t, i) { return [t, m.band.p10[i]]; }), stack: "band",
                      symbol: "none", lineStyle: { opacity: 0 }, silent: true });
        series.push({ name: "p10-p90 of all nodes", type: "line", stack: "band", symbol: "none", lineStyle: { opacity: 0 },
                      areaStyle: { color: "rgba(120,120,120,0.25)" }, silent: true,
                      data: xs.map(function (t, i) { var a = m.band.p10[i], b = m.band.p90[i]; return [t, a === null || b === null ? null : b - a]; }) });
        series.push({ name: "median of all nodes", type: "line", symbol: "none", silent: true,
                      lineStyle: { type: "dashed", color: "#555" }, data: xs.map(function (t, i) { return [t, m.band.p50[i]]; }) });
      }
      m.series.forEach(function (sr) {
        series.push({ name: sr.node + (sr.gpu === null ? "" : " gpu" + sr.gpu), type: "line", symbol: "none", sampling: "lttb",
                      connectNulls: false, data: xs.map(function (t, i) { return [t, sr.v[i]]; }) });
      });
      ch.setOption({
        animation: false, grid: { left: 60, right: 150, top: 10, bottom: 54 },
        legend: { type: "scroll", orient: "vertical", right: 0, top: 0, bottom: 20, textStyle: { fontSize: 9 } },
        tooltip: { trigger: "axis", formatter: function (ps) {
          return "t=" + fmt(ps[0].value[0], 3) + " s<br>" + ps.filter(function (p) { return p.seriesName !== "p10"; }).slice(0, 12).map(function (p) {
            return esc(p.seriesName) + ": " + fmt(p.value[1], 2); }).join("<br>"); } },
        xAxis: timeAxis(), yAxis: { type: "value", name: m.unit, nameGap: 8 },
        dataZoom: timeZoom, series: series
      });
      ch.getZr().on("click", function (e) {
        var p = ch.convertFromPixel({ gridIndex: 0 }, [e.offsetX, e.offsetY]);
        if (!p || p[0] < G.t0 || p[0] > T1) return;
        var bin = Math.max(0, Math.min(G.bins - 1, Math.floor((p[0] - G.t0) / G.dt)));
        var best = null, bd = Infinity;
        m.series.forEach(function (sr) {
          var v = sr.v[bin];
          if (v !== null && Math.abs(v - p[1]) < bd) { bd = Math.abs(v - p[1]); best = sr; }
        });
        if (!best) return;
        var t = G.t0 + (bin + 1) * G.dt;
        drill(m.title + " of " + best.node + (best.gpu === null ? "" : " gpu" + best.gpu) + " = " + fmt(best.v[bin], 2) + " " + m.unit,
              t - Math.max(G.dt, 1.0), t, [[best.node, "clicked"]]);
      });
    });
  }

  // --- flame graphs ----------------------------------------------------------------------------
  function buildTree(rowsByNode, t0, t1) {
    var root = { name: "all", v: 0, kids: {} };
    rowsByNode.forEach(function (x) {
      var node = x[0], rows = x[1];
      if (!rows) return;
      var st = D.node_rows[node].stacks;
      rows.forEach(function (r) {
        if (t0 !== null && (r[0] + 1.0 < t0 || r[0] > t1)) return;
        var n = root;
        n.v += r[2];
        var path = [node].concat(st[r[1]].map(function (i) { return S[i]; }));
        path.forEach(function (f) {
          n = n.kids[f] || (n.kids[f] = { name: f, v: 0, kids: {} });
          n.v += r[2];
        });
      });
    });
    return root;
  }
  function shareMap(tree) {
    var m = {};
    (function walk(n, key) {
      Object.keys(n.kids).forEach(function (k) {
        var c = n.kids[k], kk = key + ";" + k;
        m[kk] = c.v / (tree.v || 1);
        walk(c, kk);
      });
    })(tree, "");
    return m;
  }
  function stripRoot(tree) {
    // the node frame is the first level: the differential compares below it
    var out = { name: "all", v: 0, kids: {} };
    Object.keys(tree.kids).forEach(function (n) {
      var k = tree.kids[n].kids;
      Object.keys(k).forEach(function (f) { merge(out, k[f]); });
    });
    function merge(into, n) {
      var t = into.kids[n.name] || (into.kids[n.name] = { name: n.name, v: 0, kids: {} });
      t.v += n.v;
      into.v += into === out ? n.v : 0;
      Object.keys(n.kids).forEach(function (c) { merge(t, n.kids[c]); });
    }
    return out;
  }
  var flameChart, flameInfo, flameSearch, flameState = null;
  function flameRects(tree, base, minW) {
    var rects = [];
    (function walk(n, x, depth, key) {
      Object.keys(n.kids).sort().forEach(function (k) {
        var c = n.kids[k], kk = key + ";" + k;
        if (c.v >= minW) {
          rects.push([x, x + c.v, depth, c.name, c.v, base ? (c.v / (tree.v || 1)) - (base[kk] || 0) : null, kk]);
          walk(c, x, depth + 1, kk);
        }
        x += c.v;
      });
    })(tree, 0, 0, "");
    return rects;
  }
  function drawFlame() {
    var st = flameState;
    var q = flameSearch.value.trim().toLowerCase();
    var total = st.tree.v;
    var rects = flameRects(st.tree, st.base, total / 3000);
    var matched = 0;
    if (q) {
      // the weight of matching frames, each counted once (not again under a matching caller)
      (function walk(n) {
        Object.keys(n.kids).forEach(function (k) {
          var c = n.kids[k];
          if (c.name.toLowerCase().indexOf(q) >= 0) matched += c.v; else walk(c);
        });
      })(st.tree);
    }
    var depth = rects.reduce(function (m, r) { return Math.max(m, r[2]); }, 0) + 1;
    flameInfo.textContent = st.title + ": " + fmt(total, 0) + " " + st.unit + (q ? "; search matches " + pct(matched / (total || 1)) : "") +
      (st.base ? "; red = larger share than in the peers, blue = smaller" : "") + "; frames under 1/3000 of the total are not drawn; click a frame to zoom, the root to reset";
    if (!total) { flameInfo.textContent = st.title + ": no samples in this selection"; }
    flameChart.getDom().style.height = Math.max(160, Math.min(900, depth * 17 + 40)) + "px";
    flameChart.resize();
    var palette = ["#e6550d", "#fd8d3c", "#fdae6b", "#e6a03c", "#d9822b", "#f0b05a"];
    flameChart.setOption({
      animation: false, grid: { left: 4, right: 4, top: 4, bottom: 4 },
      tooltip: { formatter: function (p) {
        var v = p.value;
        return esc(v[3]) + "<br>" + fmt(v[4], 0) + " " + esc(st.unit) + " (" + pct(v[4] / (total || 1)) + ")" +
          (v[5] !== null ? "<br>share difference vs peers " + (100 * v[5]).toFixed(1) + " points" : ""); } },
      xAxis: { type: "value", min: st.zoom[0], max: st.zoom[1], show: false },
      yAxis: { type: "value", min: 0, max: depth, inverse: true, show: false },
      series: [{ type: "custom", data: rects, progressive: 0, encode: { x: [0, 1], y: 2 },
        renderItem: function (params, api) {
          var a = api.coord([api.value(0), api.value(2)]), b = api.coord([api.value(1), api.value(2) + 1]);
          var rect = echarts.graphic.clipRectByRect({ x: a[0], y: a[1], width: Math.max(0.5, b[0] - a[0] - 0.5), height: b[1] - a[1] - 1 },
            { x: params.coordSys.x, y: params.coordSys.y, width: params.coordSys.width, height: params.coordSys.height });
          if (!rect) return null;
          var name = rects[params.dataIndex][3], d = rects[params.dataIndex][5], fill;
          if (d !== null) {
            var x = Math.max(-1, Math.min(1, d * 10));
            fill = x >= 0 ? "rgb(255," + Math.round(235 - 180 * x) + "," + Math.round(235 - 180 * x) + ")"
                          : "rgb(" + Math.round(235 + 180 * x) + "," + Math.round(235 + 180 * x) + ",255)";
          } else fill = palette[name.length % palette.length];
          if (q && name.toLowerCase().indexOf(q) >= 0) fill = "#d62bd6";
          return { type: "group", children: [
            { type: "rect", shape: rect, style: { fill: fill } },
            { type: "text", style: { text: rect.width > 30 ? name.slice(0, Math.floor(rect.width / 6)) : "", x: rect.x + 2,
              y: rect.y + 2, fill: "#000", font: "10px sans-serif" }, silent: true }] };
        } }]
    }, true);
  }
  function renderFlames() {
    var s = section("flames", "Flame graphs",
      "Per finding, the analysis's differential (the late processes' stacks per process against the mean peer process); per node (on-CPU samples, off-CPU blocked time); per finding (the straggler's node in its flagged window) and the page's own differential (that node against the others in the window). Search highlights matching frames and gives their share.");
    var haveOn = false, haveOff = false;
    Object.keys(D.node_rows).forEach(function (n) {
      if (D.node_rows[n].samples !== null) haveOn = true;
      if (D.node_rows[n].offcpu !== null) haveOff = true;
    });
    var haveFindings = D.finding_flames.some(function (x) { return x && ((x.cpu && x.cpu.length) || (x.offcpu && x.offcpu.length)); });
    if (!haveOn && !haveOff && !haveFindings) { notRecorded(s, "CPU stacks (mode 'stacks') and off-CPU stacks"); return; }
    var kinds = [];
    var nodes = Object.keys(D.node_rows);
    if (haveOn) kinds.push(["on:*", "on-CPU, all nodes"]);
    nodes.forEach(function (n) { if (D.node_rows[n].samples !== null) kinds.push(["on:" + n, "on-CPU, " + n]); });
    if (haveOff) kinds.push(["off:*", "off-CPU, all nodes"]);
    nodes.forEach(function (n) { if (D.node_rows[n].offcpu !== null) kinds.push(["off:" + n, "off-CPU, " + n]); });
    D.summary.stragglers.forEach(function (f, i) {
      var ff = D.finding_flames[i];
      if (ff && ff.cpu && ff.cpu.length) kinds.push(["adiff:cpu:" + i, "finding " + (i + 1) + ", per process (analysis): on-CPU of " + f.node + "'s late processes vs the peers'"]);
      if (ff && ff.offcpu && ff.offcpu.length) kinds.push(["adiff:offcpu:" + i, "finding " + (i + 1) + ", per process (analysis): off-CPU of " + f.node + "'s late processes vs the peers'"]);
      if (haveOn && D.node_rows[f.node]) {
        kinds.push(["find:" + i, "finding " + (i + 1) + ": " + f.node + " in t=" + fmt(f.first_s, 0) + "-" + fmt(f.last_s, 0) + " s"]);
        kinds.push(["diff:" + i, "differential: " + f.node + " vs its peers in that window"]);
      }
    });
    var sel = el("select", { id: "gp-flame-kind" });
    kinds.forEach(function (k) { sel.appendChild(el("option", { value: k[0], text: k[1] })); });
    flameSearch = el("input", { type: "search", id: "gp-flame-search", placeholder: "search frames" });
    s.appendChild(el("div", { cls: "controls" }, [el("label", null, ["flame graph ", sel]), " ", flameSearch]));
    flameInfo = el("p", { cls: "help", id: "gp-flame-info" });
    s.appendChild(flameInfo);
    flameChart = chartDiv(s, 300);
    function pick() {
      var k = sel.value.split(":"), kind = k[0], arg = k.slice(1).join(":");
      var st = { base: null, unit: "samples", title: "" };
      if (kind === "adiff") {
        var which = k[1], fi = Number(k[2]), rows = D.finding_flames[fi][which];
        var folded = function (col) {
          var root = { name: "all", v: 0, kids: {} };
          rows.forEach(function (r) {
            var n = root, w = r[col] || 0;
            root.v += w;
            r[0].forEach(function (fid) { var nm = S[fid]; n = n.kids[nm] || (n.kids[nm] = { name: nm, v: 0, kids: {} }); n.v += w; });
          });
          return root;
        };
        st.tree = folded(1);
        st.base = shareMap(folded(2));
        st.unit = which === "cpu" ? "samples per late process" : "ns blocked per late process";
        st.title = "finding " + (fi + 1) + " (" + D.summary.stragglers[fi].node + "), per process, from the analysis: " +
          (which === "cpu" ? "on-CPU" : "off-CPU") + " of the late processes against the mean peer process";
      } else if (kind === "on" || kind === "off") {
        var field = kind === "on" ? "samples" : "offcpu";
        st.unit = kind === "on" ? "samples" : "ms blocked";
        var ns = arg === "*" ? nodes : [arg];
        st.tree = buildTree(ns.map(function (n) { return [n, D.node_rows[n][field]]; }), null, null);
        st.title = (kind === "on" ? "on-CPU samples" : "off-CPU blocked time") + " of " + (arg === "*" ? "all nodes" : arg);
      } else {
        var f = D.summary.stragglers[Number(arg)];
        var t0 = f.first_s, t1 = f.last_s;
        var target = buildTree([[f.node, D.node_rows[f.node].samples]], t0, t1);
        if (kind === "find") { st.tree = target; st.title = "finding " + (Number(arg) + 1) + ": " + f.node + " t=" + fmt(t0, 0) + "-" + fmt(t1, 0) + " s"; }
        else {
          var peers = nodes.filter(function (n) { return n !== f.node && D.node_rows[n].samples !== null; });
          st.tree = stripRoot(target);
          st.base = shareMap(stripRoot(buildTree(peers.map(function (n) { return [n, D.node_rows[n].samples]; }), t0, t1)));
          st.title = "differential: " + f.node + " vs " + peers.length + " peer node(s), t=" + fmt(t0, 0) + "-" + fmt(t1, 0) + " s";
        }
      }
      st.zoom = [0, st.tree.v || 1];
      flameState = st;
      drawFlame();
    }
    sel.addEventListener("change", pick);
    flameSearch.addEventListener("input", drawFlame);
    flameChart.on("click", function (p) {
      var v = p.value;
      flameState.zoom = (v[2] === 0 && flameState.zoom[0] === v[0] && flameState.zoom[1] === v[1]) ? [0, flameState.tree.v || 1] : [v[0], v[1]];
      drawFlame();
    });
    // open on the first finding's differential when there is one: the question the report answers
    var diff = kinds.filter(function (k) { return k[0].indexOf("adiff:cpu:") === 0; });
    if (!diff.length) diff = kinds.filter(function (k) { return k[0].indexOf("diff:") === 0; });
    if (diff.length) sel.value = diff[0][0];
    pick();
  }

  // --- clocks ----------------------------------------------------------------------------------
  // A lane per node along the job: in each stack window, the program function the node's on-CPU
  // samples were most in (the innermost frame of the program; the kernel's frames left out), so
  // the nodes' work reads side by side by collective index (issue 13: "a lane per node").
  function laneFunction(d, idx) {
    var fr = d.stacks[idx], u = d.user_frames[idx];
    return u > 0 ? fr[u - 1] : fr[fr.length - 1];
  }
  function seqAt(c, t) {  // the collective index at aligned time t (interpolated), or null
    var p = c && c.seq_t ? c.seq_t : [];
    if (!p.length || t < p[0][1]) return null;
    for (var i = 1; i < p.length; i++) {
      if (p[i][1] >= t) return Math.round(p[i - 1][0] + (p[i][0] - p[i - 1][0]) * (t - p[i - 1][1]) / Math.max(1e-12, p[i][1] - p[i - 1][1]));
    }
    return p[p.length - 1][0];
  }
  function renderStackLanes() {
    var s = section("stacklanes", "What each node ran, along the job",
      "A lane per node (rows: straggler nodes first), a column per stack window; each cell is the program function with the most on-CPU samples of that node in the window (innermost frame of the program), coloured by function (the 12 most frequent named below, others grey, white: no sample). The axis gives the first communicator's collective index at each window. Hover a cell for its share.");
    var nodes = Object.keys(D.node_rows).filter(function (n) { var r = D.node_rows[n].samples; return r && r.length; });
    if (!nodes.length) { notRecorded(s, "CPU stacks (mode 'stacks')"); return; }
    var strag = D.summary.stragglers.map(function (f) { return f.node; });
    nodes.sort(function (a, b) { return (strag.indexOf(a) < 0) - (strag.indexOf(b) < 0) || (a < b ? -1 : a > b ? 1 : 0); });
    var shown = nodes.slice(0, 64);
    if (nodes.length > shown.length) s.appendChild(el("p", { cls: "help", text: shown.length + " of " + nodes.length + " nodes shown (straggler nodes first)" }));
    // the column width: the stack window, each node's own (the nodes' windows start at other times)
    var lo = Infinity, hi = -Infinity, wins = [];
    var median = function (v) { v.sort(function (a, b) { return a - b; }); return v[Math.floor(v.length / 2)]; };
    shown.forEach(function (n) {
      var starts = {};
      D.node_rows[n].samples.forEach(function (x) { lo = Math.min(lo, x[0]); hi = Math.max(hi, x[0]); starts[x[0]] = 1; });
      var ts = Object.keys(starts).map(Number).sort(function (a, b) { return a - b; }), st = [];
      for (var i = 1; i < ts.length; i++) st.push(ts[i] - ts[i - 1]);
      if (st.length) wins.push(median(st));
    });
    var win = wins.length ? median(wins) : 1.0;
    var cols = Math.max(1, Math.min(300, Math.floor((hi - lo) / win) + 1)), bw = (hi - lo) / cols || win;
    var cells = shown.map(function () { var r = []; for (var j = 0; j < cols; j++) r.push({}); return r; });
    var total = {};
    shown.forEach(function (n, r) {
      var d = D.node_rows[n];
      d.samples.forEach(function (x) {
        var j = Math.min(cols - 1, Math.max(0, Math.floor((x[0] - lo) / bw))), f = laneFunction(d, x[1]);
        cells[r][j][f] = (cells[r][j][f] || 0) + x[2];
      });
    });
    var top = cells.map(function (row) {
      return row.map(function (m) {
        var best = null, sum = 0;
        Object.keys(m).forEach(function (f) { sum += m[f]; if (best === null || m[f] > m[best]) best = f; });
        if (best !== null) total[best] = (total[best] || 0) + 1;
        return best === null ? null : { f: Number(best), share: m[best] / sum, n: sum };
      });
    });
    var palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#393b79", "#637939", "#843c39"];
    var common = Object.keys(total).sort(function (a, b) { return total[b] - total[a]; }).slice(0, palette.length).map(Number);
    var colour = function (f) { var k = common.indexOf(f); return k < 0 ? "#999" : palette[k]; };
    var box = el("div", { cls: "heat", id: "gp-stacklanes" });
    s.appendChild(box);
    var W = Math.max(600, box.clientWidth || 1200), left = 110, right = 20, topPx = 6, bottom = 40;
    var H = Math.max(120, Math.min(900, topPx + bottom + shown.length * 12));
    var cv = el("canvas", { width: String(W), height: String(H), style: "width:" + W + "px;height:" + H + "px" });
    var tip = el("div", { cls: "heattip" });
    box.appendChild(cv);
    box.appendChild(tip);
    var ctx = cv.getContext("2d"), gw = W - left - right, gh = H - topPx - bottom, ch = gh / shown.length, cw = gw / cols;
    top.forEach(function (row, r) {
      row.forEach(function (c, j) {
        ctx.fillStyle = c === null ? "#fff" : colour(c.f);
        ctx.globalAlpha = c === null ? 1 : 0.35 + 0.65 * c.share;
        ctx.fillRect(left + j * cw, topPx + r * ch, Math.max(1, cw), Math.max(1, ch - 1));
      });
    });
    ctx.globalAlpha = 1;
    ctx.fillStyle = "#333";
    ctx.font = "9px sans-serif";
    shown.forEach(function (n, r) { ctx.fillText(n + (strag.indexOf(n) >= 0 ? " *" : ""), 2, topPx + (r + 0.5) * ch + 3); });
    ctx.font = "10px sans-serif";
    var c0 = D.comms.length ? D.comms[0] : null;
    for (var k = 0; k <= 8; k++) {
      var t = lo + k * (hi - lo) / 8, q = seqAt(c0, t);
      ctx.fillText(q === null ? fmt(t, 1) + " s" : "seq " + q, left + k * gw / 8 - 10, topPx + gh + 14);
    }
    ctx.fillText(c0 ? "collective index of " + c0.id + " (at each window's start)" : "aligned time", left + gw / 2 - 100, topPx + gh + 30);
    cv.addEventListener("mousemove", function (e) {
      var j = Math.floor((e.offsetX - left) / cw), r = Math.floor((e.offsetY - topPx) / ch);
      if (j < 0 || j >= cols || r < 0 || r >= shown.length) { tip.style.display = "none"; return; }
      var c = top[r][j], t = lo + j * bw, q = seqAt(c0, t);
      tip.textContent = shown[r] + ", " + fmt(t, 2) + " s" + (q === null ? "" : " (seq " + q + ")") + ": " +
        (c === null ? "no sample" : D.strings[c.f] + " " + pct(c.share) + " of " + c.n + " samples");
      tip.style.display = "block";
      tip.style.left = (e.offsetX + 12) + "px";
      tip.style.top = (e.offsetY + 12) + "px";
    });
    cv.addEventListener("mouseleave", function () { tip.style.display = "none"; });
    var legend = el("p", { cls: "help", id: "gp-stacklanes-legend" });
    common.forEach(function (f, k) {
      legend.appendChild(el("span", { style: "color:" + palette[k] + ";margin-right:12px", text: "\u25a0 " + D.strings[f] }));
    });
    s.appendChild(legend);
  }
  function renderClocks() {
    var s = section("clocks", "Clock offsets with their error intervals",
      "Each node's offset from the reference clock (us) at each segment of its clock model, with the interval of offsets the collectives allow: as error bars while the points are few, and as its half-width over time below.");
    var series = [], any = false;
    // error bars on the offsets while they stay readable; beyond, the half-width chart below has them
    var total = D.clocks.reduce(function (n, c) { return n + c.points.length; }, 0), bars = total <= 600;
    D.clocks.forEach(function (c) {
      if (!c.points.length) return;
      any = true;
      series.push({ name: c.node, type: "line", data: c.points.map(function (p) { return [p[0], p[1]]; }),
                    symbolSize: bars ? 5 : 0, showSymbol: bars });
      if (bars) series.push({ name: c.node, type: "custom", data: c.points.filter(function (p) { return p[2] !== null; }).map(function (p) { return [p[0], p[2], p[3]]; }),
        renderItem: function (params, api) {
          var lo = api.coord([api.value(0), api.value(1)]), hi = api.coord([api.value(0), api.value(2)]);
          return { type: "group", children: [
            { type: "line", shape: { x1: lo[0], y1: lo[1], x2: hi[0], y2: hi[1] }, style: { stroke: api.visual("color"), lineWidth: 1 } },
            { type: "line", shape: { x1: lo[0] - 3, y1: lo[1], x2: lo[0] + 3, y2: lo[1] }, style: { stroke: api.visual("color") } },
            { type: "line", shape: { x1: hi[0] - 3, y1: hi[1], x2: hi[0] + 3, y2: hi[1] }, style: { stroke: api.visual("color") } }] };
        }, encode: { x: 0, y: [1, 2] } });
    });
    if (any) {
      var ch = chartDiv(s, 260);
      ch.setOption({ animation: false, grid: { left: 70, right: 150, top: 10, bottom: 40 },
        legend: { type: "scroll", orient: "vertical", right: 0, top: 0, textStyle: { fontSize: 9 } },
        tooltip: { trigger: "item", formatter: function (p) { return esc(p.seriesName) + ": t=" + fmt(p.value[0], 2) + " s, " +
          fmt(p.value[1], 2) + (p.value.length > 2 ? " to " + fmt(p.value[2], 2) : "") + " us"; } },
        xAxis: { type: "value", name: "aligned time (s)", nameLocation: "middle", nameGap: 22, scale: true },
        yAxis: { type: "value", name: "offset (us)", scale: true }, series: series });
      // the intervals are microseconds where the offsets are milliseconds: their half-widths on their own axis
      var widths = D.clocks.filter(function (c) { return c.points.some(function (p) { return p[2] !== null; }); });
      if (widths.length) {
        s.appendChild(el("h3", { text: "Error interval half-width over time (us): how well the collectives pin each clock" }));
        var cw = chartDiv(s, 220);
        cw.setOption({ animation: false, grid: { left: 70, right: 150, top: 10, bottom: 40 },
          legend: { type: "scroll", orient: "vertical", right: 0, top: 0, textStyle: { fontSize: 9 } },
          tooltip: { trigger: "item", formatter: function (p) { return esc(p.seriesName) + ": t=" + fmt(p.value[0], 2) + " s, +-" + fmt(p.value[1], 2) + " us"; } },
          xAxis: { type: "value", name: "aligned time (s)", nameLocation: "middle", nameGap: 22, scale: true },
          yAxis: { type: "value", name: "+- us" },
          series: widths.map(function (c) {
            return { name: c.node, type: "line", symbolSize: 4, data: c.points.filter(function (p) { return p[2] !== null; })
              .map(function (p) { return [p[0], (p[3] - p[2]) / 2]; }) }; }) });
      }
    } else notRecorded(s, "Clock model segments");
    s.appendChild(el("h3", { text: "Per node" }));
    s.appendChild(el("div", { cls: "tablewrap" }, [table(["node", "host", "aligned", "reference", "offset us", "drift ppm", "segments", "residual us", "+- us",
      "interval lo us", "interval hi us", "points", "calls", "drops"], D.clock_table.map(function (n) {
      return [n.node, n.host, n.aligned, n.reference, n.offset_us, n.drift_ppm, n.segments, n.residual_us, n.uncertainty_us,
              n.interval_lo_us, n.interval_hi_us, n.n_points, n.calls, n.drops]; }))]));
  }

  // --- tables ----------------------------------------------------------------------------------
  function renderTables() {
    var s = section("ranks", "Per rank", "Wait per (communicator, rank), the ranks that waited most first; times last = instances it arrived last.");
    if (!D.ranks.length) notRecorded(s, "Collective ranks");
    else {
      var filt = el("input", { type: "search", id: "gp-rank-filter", placeholder: "filter by node or communicator" });
      s.appendChild(filt);
      var holder = el("div", { cls: "tablewrap" });
      s.appendChild(holder);
      var draw = function () {
        var q = filt.value.trim().toLowerCase();
        holder.textContent = "";
        holder.appendChild(table(["communicator", "rank", "node", "instances", "times last", "wait ms"],
          D.ranks.filter(function (r) { return !q || String(r.node).toLowerCase().indexOf(q) >= 0 || r.comm.indexOf(q) >= 0; })
            .map(function (r) { return [r.comm, r.rank, r.node, r.instances, r.last, r.wait_ms]; })));
      };
      filt.addEventListener("input", draw);
      draw();
    }
    var g = section("gpus", "Per GPU, with its roofline class",
      "Class from the mean GPM activity (docs/report.md): underused, memory-bound, compute-bound or latency-bound; flags name suspicious patterns such as busy SMs with idle tensor pipes.");
    if (!D.gpus.length) notRecorded(g, "GPUs");
    else {
      g.appendChild(el("div", { cls: "tablewrap" }, [table(["node", "gpu", "name", "util %", "SM %", "occupancy %", "tensor %", "DRAM %", "mem max GiB", "class", "why", "flags", "per NVTX phase", "peaks of"],
        D.gpus.map(function (x) { return [x.node, x.gpu, x.name, x.util_gpu, x.sm_activity, x.sm_occupancy, x.tensor_activity,
          x.dram_bw_util, x.mem_gib, x.roofline, x.why, (x.flags || []).join("; ") || "-",
          (x.phases || []).map(function (p) { return p.range + ": " + p.roofline + (p.flags.length ? " (flagged)" : ""); }).join("; ") || "-",
          x.peaks_model || "unknown model"]; }))]));
    }
    var ph = section("phases", "NVTX phases per node and process", "Seconds in each NVTX range (exclusive of nested ranges), from the analysis.");
    if (!D.nvtx_phases.length) notRecorded(ph, "NVTX ranges");
    else ph.appendChild(el("div", { cls: "tablewrap" }, [table(["node", "pid", "range", "seconds"],
      D.nvtx_phases.map(function (r) { return [r.node, r.pid, r.range, r.s]; }))]));
    var kt = section("kernels", "GPU kernel time per node and process", "Seconds each kernel ran on the GPU (CUPTI), from the analysis.");
    if (!D.kernel_time.length) notRecorded(kt, "CUDA kernel times (mode kernels, CUPTI)");
    else kt.appendChild(el("div", { cls: "tablewrap" }, [table(["node", "pid", "kernel", "seconds"],
      D.kernel_time.map(function (r) { return [r.node, r.pid, r.kernel, r.s]; }))]));
    var nl = section("nccl", "NCCL's own log", "What the job's NCCL_DEBUG output says (topology, operation counts), and NCCL's counts against ours.");
    if (!D.nccl_log) notRecorded(nl, "NCCL_DEBUG log");
    else if (D.nccl_log.error) nl.appendChild(el("p", { text: "not read: " + D.nccl_log.error }));
    else {
      nl.appendChild(el("pre", { text: D.nccl_log.summary.join("\n") }));
      nl.appendChild(el("p", { text: "NCCL's operation counts agree with the collectors' for " + D.nccl_log.processes_agreeing +
        " of " + D.nccl_log.processes_compared + " (process, operation) pairs" }));
      nl.appendChild(el("div", { cls: "tablewrap" }, [table(["host", "pid", "op", "NCCL calls", "our calls", "NCCL bytes", "our bytes", "agree"],
        D.nccl_log.calls_against_ours.map(function (r) { return [r.host, r.pid, r.op, r.log_calls, r.our_calls, r.log_bytes, r.our_bytes, r.agree ? "yes" : "no"]; }))]));
    }
    g.appendChild(el("h3", { text: "Peaks per GPU model (dense, datasheet)" }));
    g.appendChild(table(["model", "FP32 TFLOP/s", "FP16/BF16 tensor TFLOP/s", "memory TB/s", "source"], D.roofline_peaks.map(function (p) {
      return [p.model, p.fp32_tflops, p.tensor_fp16_dense_tflops, p.mem_tb_s, p.source]; })));
  }

  // --- the page --------------------------------------------------------------------------------
  var steps = [["summary", renderSummary], ["lanes", renderLanes], ["metrics", renderMetrics], ["drill", renderDrillShell],
               ["flames", renderFlames], ["stacklanes", renderStackLanes], ["clocks", renderClocks], ["tables", renderTables]];
  if (D.synthetic) app.appendChild(el("div", { cls: "syn", id: "gp-synthetic", text: D.synthetic_banner }));
  var nav = el("nav", null, ["sections: "]);
  app.appendChild(nav);
  var drillSection = null;
  steps.forEach(function (st) {
    var before = app.children.length, t0 = performance.now();
    try {
      var r = st[1]();
      if (st[0] === "drill") drillSection = r;
    } catch (e) {
      window.gpErrors.push(st[0] + ": " + (e && e.stack ? e.stack : String(e)));
      console.error("gpuprof report: section " + st[0] + " failed: " + e);
      app.appendChild(el("p", { cls: "error", text: "section " + st[0] + " failed: " + e }));
    }
    for (var i = before; i < app.children.length; i++) {
      var sec = app.children[i];
      if (sec.tagName === "SECTION") {
        sec.setAttribute("data-rendered", "1");
        sec.setAttribute("data-draw-ms", String(Math.round(performance.now() - t0)));
        var a = el("a", { href: "#" + sec.id, text: sec.querySelector("h2").textContent.split(":")[0] });
        nav.appendChild(a);
        nav.appendChild(document.createTextNode(" "));
      }
    }
  });
  // the drill-down section sits after the lanes and metrics in the page, so what it shows is close to the click
  if (drillSection && document.getElementById("sec-lanes")) {
    app.insertBefore(drillSection, document.getElementById("sec-metrics") || null);
  }
  if (timeCharts.length > 1) echarts.connect(timeCharts);
  // open the drill-down on the first straggler's worst instance (what the report is about)
  try {
    if (laneChart && D.comms.length) {
      var c0 = D.comms[0], lastCell = null;
      c0.cells.forEach(function (x) { if (x[6] && x[1] === c0.worst_seq) lastCell = x; });
      if (lastCell) {
        var nodes = [[c0.rank_nodes[lastCell[0]], "arrived last"]];
        c0.rank_nodes.forEach(function (n) { if (n !== null && !nodes.some(function (m) { return m[0] === n; })) nodes.push([n, "peer"]); });
        drill("Instance seq " + lastCell[1] + " of " + c0.id + " (largest arrival skew window), rank " + c0.ranks[lastCell[0]],
              lastCell[2] - 1.0, lastCell[2], nodes);
      }
    }
  } catch (e) {
    window.gpErrors.push("drill: " + e);
    console.error("gpuprof report: drill-down failed: " + e);
  }
  // "#only=lanes" shows one section alone (to share or print it; docs/img/ screenshots are taken so)
  var only = /^#only=([a-z]+)$/.exec(location.hash);
  if (only && document.getElementById("sec-" + only[1])) {
    Array.prototype.forEach.call(app.querySelectorAll("section, nav"), function (sec) {
      if (sec.id !== "sec-" + only[1]) sec.style.display = "none";
    });
    charts.forEach(function (c) { c.resize(); });
  }
  window.addEventListener("resize", function () { charts.forEach(function (c) { c.resize(); }); });
  var errs = el("div", { id: "gp-errors", "data-count": String(window.gpErrors.length) });
  window.gpErrors.forEach(function (e) { errs.appendChild(el("pre", { text: e })); });
  app.appendChild(errs);
  var done = el("div", { id: "gp-done", "data-ms": String(Math.round(performance.now())),
    text: "drawn in " + Math.round(performance.now()) + " ms" });
  app.appendChild(done);
  scriptDone = true;
  chartPainted();
})();
