// The token under the pointer, described in the sticky panel: id, text, logprob, version, call.
document.addEventListener("mouseover", (event) => {
  const token = event.target.closest(".tokens .t");
  const panel = document.getElementById("tok");
  if (!token || !panel) return;
  const d = token.dataset;
  const text = JSON.stringify(token.textContent);
  panel.textContent = d.l === undefined
    ? `prompt token ${d.i} ${text}`
    : `sampled token ${d.i} ${text}  logprob ${d.l} (p ${Math.exp(+d.l).toFixed(3)})  policy version ${d.v}  call ${d.c}` +
      (d.q === undefined ? "" : `  learner logprob ${d.q} (${(d.q - d.l >= 0 ? "+" : "") + (d.q - d.l).toFixed(4)})`);
});

// What the sampled tokens are shaded by: behaviour p, the learner's mismatch, the advantage.
document.getElementById("shade")?.addEventListener("change", (event) => {
  document.body.dataset.shade = event.target.value;
});
