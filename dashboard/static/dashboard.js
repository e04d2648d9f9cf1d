// Auto-refresh: every data-refresh seconds, fetch this page's live part and
// swap it in; paused while the tab is hidden. No framework, no build step.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live || !live.dataset.refresh) { return; }
  var every = Math.max(0.5, parseFloat(live.dataset.refresh)) * 1000;
  var busy = false;
  function tick() {
    if (busy || document.hidden) { return; }
    busy = true;
    fetch(window.location.href, { headers: { "X-Duebox-Partial": "1" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(function (html) { live.innerHTML = html; live.classList.remove("stale"); })
      .catch(function () { live.classList.add("stale"); })
      .then(function () { busy = false; });
  }
  window.setInterval(tick, every);
})();
