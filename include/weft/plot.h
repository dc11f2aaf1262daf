// weft/plot.h — the loss curve of a run, as an SVG picture.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace weft {

// Writes an SVG line chart of (step, loss) points: the training loss as a
// line, the validation loss as marked points joined by a dashed line, with
// labelled axes and a legend. Throws Error when the file cannot be written.
void write_loss_plot(const std::string& path, const std::vector<std::pair<double, double>>& train,
                     const std::vector<std::pair<double, double>>& validation,
                     const std::string& title);

}  // namespace weft
