// oomguard's dashboard: every element with data-live is fetched again from its URL (the page's
// live part, rendered and escaped on the server) every few seconds while the tab is shown.
"use strict";
(function () {
  const seconds = Number(document.body.dataset.refreshSeconds) || 3;
  async function refresh(element) {
    try {
      const response = await fetch(element.dataset.live, { credentials: "same-origin", cache: "no-store" });
      if (response.ok) {
        element.innerHTML = await response.text();
        element.classList.remove("stale");
      } else {
        element.classList.add("stale");
      }
    } catch (error) {
      element.classList.add("stale");  // the server is gone for now; the next round tries again
    }
  }
  setInterval(function () {
    if (!document.hidden) {
      document.querySelectorAll("[data-live]").forEach(refresh);
    }
  }, seconds * 1000);
})();
