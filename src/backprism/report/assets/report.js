// Draws the Plotly figures embedded as JSON in #backprism-data into the .chart elements
// (data-figure = index into "figures"); sets <body data-ready="1"> once all are drawn.
(function () {
  "use strict";
  var payload = JSON.parse(document.getElementById("backprism-data").textContent);
  var charts = document.querySelectorAll(".chart[data-figure]");
  var drawn = Array.prototype.map.call(charts, function (div) {
    var fig = payload.figures[Number(div.dataset.figure)];
    return Plotly.newPlot(div, fig.data, fig.layout, payload.config);
  });
  Promise.all(drawn).then(function () {
    document.body.dataset.ready = "1";
  }, function (err) {
    document.body.dataset.ready = "error";
    console.error("backprism report: " + err);
  });
})();
